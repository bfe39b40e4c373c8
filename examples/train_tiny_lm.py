"""Train a tiny linear-attention language model on the CPU with linattn.torch, next to the same model
with the attention written in PyTorch (chunked form); same seed, same data: the losses agree.

    python examples/train_tiny_lm.py            # 300 steps
    python examples/train_tiny_lm.py --small    # 40 steps

The task: predict the next character of a text made of repeated words (a model has to look back to
do better than the letter frequencies).
"""
import argparse
import time

import numpy as np
import torch

import linattn.torch as lt
from linattn.benchmarks.torch_transformer import chunked_linear_attention

TEXT = ("the quick brown fox jumps over the lazy dog while seven wizards quietly hex a jovial sphinx "
        "of black quartz and judge my vow ") * 40


def torch_chunked(q, k, v):
    """Causal linear attention (elu + 1) in PyTorch's chunkwise form, differentiable by autograd."""
    return chunked_linear_attention(q, k, v, chunk=32)[0]


class Model(torch.nn.Module):
    def __init__(self, vocab, d=64, heads=4, layers=2, attention=lt.causal_linear_attention):
        super().__init__()
        self.heads, self.attention = heads, attention
        self.embed = torch.nn.Embedding(vocab, d)
        self.blocks = torch.nn.ModuleList()
        for _ in range(layers):
            self.blocks.append(torch.nn.ModuleDict({
                "ln1": torch.nn.LayerNorm(d), "qkv": torch.nn.Linear(d, 3 * d), "proj": torch.nn.Linear(d, d),
                "ln2": torch.nn.LayerNorm(d), "mlp": torch.nn.Sequential(
                    torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d))}))
        self.out = torch.nn.Linear(d, vocab)

    def forward(self, tokens):
        x = self.embed(tokens)
        b, n, d = x.shape
        for blk in self.blocks:
            q, k, v = blk["qkv"](blk["ln1"](x)).reshape(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
            att = self.attention(q.contiguous(), k.contiguous(), v.contiguous())
            x = x + blk["proj"](att.transpose(1, 2).reshape(b, n, d))
            x = x + blk["mlp"](blk["ln2"](x))
        return self.out(x)


def train(attention, steps, data, vocab, seed=0, batch=8, n=128):
    torch.manual_seed(seed)
    model = Model(vocab, attention=attention)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    rng = np.random.default_rng(seed)
    losses = []
    for _ in range(steps):
        starts = rng.integers(0, len(data) - n - 1, batch)
        x = torch.from_numpy(np.stack([data[s:s + n] for s in starts]))
        y = torch.from_numpy(np.stack([data[s + 1:s + n + 1] for s in starts]))
        loss = torch.nn.functional.cross_entropy(model(x).reshape(-1, vocab), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="40 steps")
    parser.add_argument("--steps", type=int, default=None)
    args = parser.parse_args()
    steps = args.steps or (40 if args.small else 300)
    torch.set_num_threads(1)  # the same arithmetic order in both runs, run after run
    chars = sorted(set(TEXT))
    data = np.array([chars.index(c) for c in TEXT], np.int64)
    for attention in (lt.causal_linear_attention, torch_chunked):  # first calls (linattn: compile or cache load)
        train(attention, 2, data, len(chars))
    t = time.perf_counter()
    ours = train(lt.causal_linear_attention, steps, data, len(chars))
    t_ours = time.perf_counter() - t
    t = time.perf_counter()
    theirs = train(torch_chunked, steps, data, len(chars))
    t_theirs = time.perf_counter() - t
    print("step   linattn.torch   PyTorch chunked")
    for i in range(0, steps, max(1, steps // 10)):
        print(f"{i:4d}   {ours[i]:13.4f}   {theirs[i]:15.4f}")
    print(f"{steps - 1:4d}   {ours[-1]:13.4f}   {theirs[-1]:15.4f}")
    rel = [abs(a - b) / b for a, b in zip(ours, theirs)]
    early, late = max(rel[:100]), max(rel)
    # float32 rounding differs between the two attentions; training amplifies it slowly
    print(f"largest relative difference of the losses: {early:.1e} in the first 100 steps, {late:.1e} in all; "
          f"training took {t_ours:.1f} s with linattn, {t_theirs:.1f} s with the PyTorch attention (after two warm-up "
          f"steps each)")
    if not (early < 1e-4 and late < 1e-2 and ours[-1] < 0.5 * ours[0]):
        raise SystemExit("the losses disagree, or did not fall")
    print("the losses agree and fall")


if __name__ == "__main__":
    main()
