"""Memory: a long sequence must need O(B*H*D*Dv) beyond its inputs and output."""
import tracemalloc


import linattn

from .common import SMOKE, inputs

SHAPE = (1, 1, 1 << (14 if SMOKE else 20), 64)  # a million positions: inputs and output 256 MiB each


class LongSequence:
    timeout = 300

    def setup(self):
        self.q, self.k, self.v = inputs(SHAPE)
        linattn.causal_linear_attention(self.q[..., :64, :], self.k[..., :64, :], self.v[..., :64, :])

    def peakmem_causal(self):
        linattn.causal_linear_attention(self.q, self.k, self.v)

    def track_extra_mib_beyond_output(self):
        """NumPy-level allocations during the call minus the output (kernel scratch is per chunk)."""
        tracemalloc.start()
        out = linattn.causal_linear_attention(self.q, self.k, self.v)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        return (peak - out.nbytes) / 2**20

    track_extra_mib_beyond_output.unit = "MiB"
