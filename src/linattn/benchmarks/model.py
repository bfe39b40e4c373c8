"""``python -m linattn bench --model``: the benchmark transformer (benchmarks/transformer.py) in NumPy with
linattn, next to the same model in PyTorch eager with a chunked linear attention and with softmax
attention (SDPA and a key/value cache), when torch is installed.

Each framework runs in a process of its own (their thread pools would otherwise compete), on the
same weights; the runs report tokens per second for prefill and decoding, the share of the model's
time that attention takes, and attention's cost inside the model against the same calls timed
alone. The PyTorch chunked model computes the same function as the NumPy one: their logits are
compared.
"""
import json
import os
import subprocess
import sys
import time

import numpy as np

from .transformer import CONFIG

#: (name, batch, prompt length); decoding continues each prompt.
PREFILLS = [("1x2048", 1, 2048), ("8x512", 8, 512)]
QUICK_PREFILLS = [("1x256", 1, 256), ("2x128", 2, 128)]
NEW_TOKENS, QUICK_NEW_TOKENS = 64, 8
VARIANTS = {"numpy": ("linattn", "skip"), "torch": ("chunked", "sdpa", "skip")}
#: Timed prefills of each model (in turn) by default: ``bench --model --rounds`` sets it.
ROUNDS = 9


def _median_time(fn, repeat):
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def _tokens(batch, n, seed=1):
    return np.random.default_rng(seed).integers(0, CONFIG["vocab"], (batch, n))


def _attention_call(weights, batch, n):
    """One layer's attention call, on inputs made as the model makes them (a function of no arguments)."""
    import linattn

    from .transformer import layer_norm

    p = weights.layers[0]
    d, h = weights.embed.shape[1], weights.heads
    x = weights.embed[_tokens(batch, n).reshape(-1)]
    qkv = (layer_norm(x, p["ln1_g"], p["ln1_b"]) @ p["w_qkv"]).reshape(batch, n, 3, h, d // h)
    q, k, v = (qkv[:, :, i].transpose(0, 2, 1, 3) for i in range(3))
    buf = np.zeros((batch, n, h, d // h), np.float32).transpose(0, 2, 1, 3)

    def call():
        linattn.causal_linear_attention(q, k, v, out=buf, return_state=True)

    call()
    return call


def _attention_alone(weights, batch, n, repeat):
    """Seconds for one layer's attention call, back to back, on inputs made as the model makes them."""
    return _median_time(_attention_call(weights, batch, n), repeat)


def _attention_in_model(model, tokens, repeat):
    """Seconds spent inside the attention calls of one prefill (timed around each call)."""
    import linattn

    spent = []
    inner = linattn.causal_linear_attention

    def timed(*args, **kwargs):
        t = time.perf_counter()
        res = inner(*args, **kwargs)
        spent.append(time.perf_counter() - t)
        return res

    linattn.causal_linear_attention = timed
    try:
        per_call = []
        for _ in range(repeat):
            spent.clear()
            model.prefill(tokens)
            per_call.append(sum(spent))
    finally:
        linattn.causal_linear_attention = inner
    return float(np.median(per_call))


def run_framework(framework, quick=False, repeat=ROUNDS):
    """Time every variant of one framework in this process; returns a JSON-able dict."""
    from .transformer import NumpyTransformer, Weights

    weights = Weights.random(**CONFIG)
    prefills = QUICK_PREFILLS if quick else PREFILLS
    new_tokens = QUICK_NEW_TOKENS if quick else NEW_TOKENS
    out = {"framework": framework, "rows": {}}
    if framework == "torch":
        import torch

        from .torch_transformer import TorchTransformer, as_numpy

        out["torch"] = torch.__version__
        make = (lambda att: TorchTransformer(weights, att))  # noqa: E731
        to_input, to_output = torch.from_numpy, as_numpy
    else:
        make = (lambda att: NumpyTransformer(weights, att))  # noqa: E731
        to_input, to_output = (lambda x: x), (lambda x: x)  # noqa: E731
    models = {variant: make(variant) for variant in VARIANTS[framework]}
    for name, batch, n in prefills:
        tokens = to_input(_tokens(batch, n))
        runs = {variant: model.prefill for variant, model in models.items()}
        if framework == "numpy":  # and every layer's attention call alone, back to back
            call = _attention_call(weights, batch, n)
            runs["alone"] = lambda _, layers=range(len(weights.layers)): [call() for _ in layers]
        times = {variant: [] for variant in runs}
        for run in runs.values():
            run(tokens)  # compile / warm up
        for _ in range(repeat):  # in turn, so that the machine's drift hits them alike
            for variant, run in runs.items():
                t = time.perf_counter()
                run(tokens)
                times[variant].append(time.perf_counter() - t)
        for variant, model in models.items():
            logits, states = model.prefill(tokens)
            if variant == "skip" and framework == "numpy":
                states = model.empty_states(batch)
            first = to_output(logits)
            nxt = to_input(np.asarray(first.argmax(-1)))
            steps, decoded = [], []
            for _ in range(new_tokens):
                t = time.perf_counter()
                logits = model.decode(nxt, states)
                steps.append(time.perf_counter() - t)
                decoded.append(to_output(logits))
                nxt = to_input(np.asarray(decoded[-1].argmax(-1)))
            row = {"prefill_s": float(np.median(times[variant])), "prefill_all_s": times[variant],
                   "decode_s": float(np.median(steps[1:] or steps)), "batch": batch, "n": n,
                   "logits": [first.tolist(), decoded[0].tolist()]}
            if framework == "numpy" and variant == "linattn":
                row["attention_in_model_s"] = _attention_in_model(model, tokens, repeat)
                row["attention_alone_s"] = float(np.median(times["alone"]))
                row["attention_alone_all_s"] = times["alone"]
            out["rows"][f"{variant} {name}"] = row
    return out


def _subprocess(framework, quick, rounds):
    cmd = ([sys.executable, "-m", "linattn.benchmarks.model", "--worker", framework, "--rounds", str(rounds)]
           + (["--quick"] if quick else []))
    res = subprocess.run(cmd, capture_output=True, text=True, check=False, env=dict(os.environ))
    if res.returncode != 0:
        raise RuntimeError(f"the {framework} benchmark process failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def torch_available():
    try:
        import importlib.util

        return importlib.util.find_spec("torch") is not None
    except (ImportError, ValueError):
        return False


def run(quick=False, stream=sys.stdout, with_torch=None, rounds=ROUNDS):
    """Run the model benchmark (each framework in its own process, ``rounds`` timed prefills of each model
    in turn); prints and returns the table."""
    with_torch = torch_available() if with_torch is None else with_torch
    results = {"numpy": _subprocess("numpy", quick, rounds)}
    if with_torch:
        results["torch"] = _subprocess("torch", quick, rounds)
    rows = summarize(results)
    print_table(rows, results, stream)
    return rows, results


def median_interval(values, scale=1.0, level=0.95, draws=2000, seed=0):
    """(median, low, high) of ``values`` over ``scale``: the median and a bootstrap interval of it at
    ``level`` (seeded: the same values give the same interval). A model's time with attention minus its
    time without is a small difference of two large noisy times: the interval says how much of a
    round-to-round ratio is the machine's noise."""
    x = np.asarray(values, np.float64) / scale
    if x.size == 0:
        raise ValueError("values: expected at least one value, got none")
    boot = np.median(np.random.default_rng(seed).choice(x, (draws, x.size)), axis=1)
    tail = 100 * (1 - level) / 2
    return float(np.median(x)), float(np.percentile(boot, tail)), float(np.percentile(boot, 100 - tail))


def summarize(results):
    """One row per prefill case: tokens/s of each model, attention's share and in-model cost."""
    np_rows = results["numpy"]["rows"]
    names = [key.split(" ", 1)[1] for key in np_rows if key.startswith("linattn ")]
    rows = []
    for name in names:
        la, skip = np_rows[f"linattn {name}"], np_rows[f"skip {name}"]
        tokens = la["batch"] * la["n"]
        row = {"case": name, "batch": la["batch"],
               "numpy_prefill_tok_s": tokens / la["prefill_s"],
               "numpy_skip_prefill_tok_s": tokens / skip["prefill_s"],
               "numpy_decode_tok_s": la["batch"] / la["decode_s"],
               # time inside the attention calls of a prefill over the prefill's time (both medians): measured
               # directly, where the model with minus without attention is a small difference of two noisy times
               "attention_share": la["attention_in_model_s"] / la["prefill_s"],
               "in_model_over_alone_calls": la["attention_in_model_s"] / la["attention_alone_s"]}
        # the rounds ran the models with and without attention and the calls alone in turn: each round's
        # (with - without) / alone is one sample
        (row["in_model_over_alone_model"], *row["in_model_over_alone_model_interval"]) = median_interval(
            np.subtract(la["prefill_all_s"], skip["prefill_all_s"]) / np.asarray(la["attention_alone_all_s"]))
        row["rounds"] = len(la["prefill_all_s"])
        if "torch" in results:
            t_rows = results["torch"]["rows"]
            for att in ("chunked", "sdpa"):
                tr = t_rows[f"{att} {name}"]
                row[f"torch_{att}_prefill_tok_s"] = tokens / tr["prefill_s"]
                row[f"torch_{att}_decode_tok_s"] = tr["batch"] / tr["decode_s"]
            row["torch_skip_prefill_tok_s"] = tokens / t_rows[f"skip {name}"]["prefill_s"]
            ref = np.asarray(t_rows[f"chunked {name}"]["logits"], np.float64)
            got = np.asarray(la["logits"], np.float64)
            row["logits_max_rel_diff"] = float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))
        rows.append(row)
    return rows


def print_table(rows, results, stream=sys.stdout):
    torch_on = "torch" in results
    head = f"{'case':8s} {'':22s} {'NumPy+linattn':>14s}"
    if torch_on:
        head += f" {'PyTorch+chunked':>16s} {'PyTorch+SDPA':>13s}"
    print(head, file=stream)
    for r in rows:
        for what, key in (("prefill tokens/s", "prefill_tok_s"), ("decode tokens/s", "decode_tok_s")):
            line = f"{r['case']:8s} {what:22s} {r['numpy_' + key]:14.0f}"
            if torch_on:
                line += f" {r['torch_chunked_' + key]:16.0f} {r['torch_sdpa_' + key]:13.0f}"
            print(line, file=stream)
        line = f"{r['case']:8s} {'prefill, no attention':22s} {r['numpy_skip_prefill_tok_s']:14.0f}"
        if torch_on:
            line += f" {r['torch_skip_prefill_tok_s']:16.0f} {'':>13s}"
        print(line + "   (the framework alone)", file=stream)
    print(file=stream)
    for r in rows:
        low, high = r["in_model_over_alone_model_interval"]
        extra = f", logits vs PyTorch chunked: max rel diff {r['logits_max_rel_diff']:.1e}" if torch_on else ""
        print(f"{r['case']}: attention is {100 * r['attention_share']:.1f}% of NumPy+linattn prefill; inside the "
              f"model its calls take {r['in_model_over_alone_calls']:.2f}x their time alone (model with - without "
              f"attention: {r['in_model_over_alone_model']:.2f}x, 95% interval {low:.2f} to {high:.2f} over "
              f"{r['rounds']} rounds){extra}", file=stream)
    cfg = ", ".join(f"{k} {v}" for k, v in CONFIG.items())
    print(f"\nmodel: {cfg}, MLP 4x with GELU; float32; each framework in its own process"
          + (f" (torch {results['torch'].get('torch')})" if torch_on else "; torch not installed"), file=stream)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    rounds = int(argv[argv.index("--rounds") + 1]) if "--rounds" in argv else ROUNDS
    if "--worker" in argv:
        framework = argv[argv.index("--worker") + 1]
        print(json.dumps(run_framework(framework, quick="--quick" in argv, repeat=rounds)))
        return 0
    run(quick="--quick" in argv, rounds=rounds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
