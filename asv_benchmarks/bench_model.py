"""The benchmark transformer (linattn.benchmarks.transformer) in NumPy with linattn: prefill, one
decoding step, and attention's cost inside the model against the same calls alone (target <= 1.15).
PyTorch's twins run in ``python -m linattn bench --model`` (each framework in its own process)."""
import time

import numpy as np

from linattn.benchmarks import model
from linattn.benchmarks.transformer import CONFIG, NumpyTransformer, Weights

from .common import SMOKE

CASES = {"1x2048": (1, 2048), "8x512": (8, 512)}
if SMOKE:
    CASES = {"1x2048": (1, 128), "8x512": (2, 64)}


class Model:
    params = list(CASES)
    param_names = ["case"]
    timeout = 600
    repeat = 5
    number = 1

    def setup(self, case):
        self.batch, self.n = CASES[case]
        self.weights = Weights.random(**CONFIG)
        self.model = NumpyTransformer(self.weights)
        self.skip = NumpyTransformer(self.weights, "skip")
        self.tokens = model._tokens(self.batch, self.n)
        logits, self.states = self.model.prefill(self.tokens)
        self.skip.prefill(self.tokens)
        self.next = logits.argmax(-1)
        self.model.decode(self.next, self.states)

    def time_prefill(self, case):
        self.model.prefill(self.tokens)

    def time_prefill_without_attention(self, case):
        self.skip.prefill(self.tokens)

    def time_decode_step(self, case):
        self.model.decode(self.next, self.states)

    def track_attention_in_model_over_alone(self, case):
        inside = model._attention_in_model(self.model, self.tokens, 5)
        alone = model._attention_alone(self.weights, self.batch, self.n, 15) * len(self.weights.layers)
        return inside / alone

    track_attention_in_model_over_alone.unit = "x alone"

    def track_prefill_tokens_per_s(self, case):
        t = time.perf_counter()
        self.model.prefill(self.tokens)
        return self.batch * self.n / (time.perf_counter() - t)

    track_prefill_tokens_per_s.unit = "tokens/s"
