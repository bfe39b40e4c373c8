"""pytest's collection: modules that need an optional dependency are collected only when it is installed."""
import importlib.util

collect_ignore = []
if importlib.util.find_spec("torch") is None:
    # They import torch at module level (their tests skip without it): the model benchmark's PyTorch
    # twin and the autograd adapter.
    collect_ignore += ["src/linattn/benchmarks/torch_transformer.py", "src/linattn/torch.py"]
