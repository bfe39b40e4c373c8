"""pytest's collection: modules that need an optional dependency are collected only when it is installed."""
import importlib.util

collect_ignore = []
if importlib.util.find_spec("torch") is None:
    # The model benchmark's PyTorch twin imports torch at module level (tests that use it skip without it).
    collect_ignore.append("src/linattn/benchmarks/torch_transformer.py")
