"""Run by test_elementwise.test_without_fma in a process that compiles for an x86 CPU without FMA
(NUMBA_CPU_NAME=x86-64-v2): the exps and elementwise maps within their ulps, and the same bits for a value
mapped alone or among others, where multiply-adds are a product and a sum."""
import numba
import numpy as np
from numba.core.registry import cpu_target

from linattn import feature_maps as fm
from linattn.cpu.elementwise import elu1, exp_le0, target_has_fma
from linattn.cpu.mapfns import exp_any

from conftest import exact_exp  # (this script's folder is the first on sys.path)


@numba.njit(fastmath={"contract", "reassoc", "nsz", "arcp"})
def maps(x, elu, le0, anywhere):
    for i in range(x.shape[0]):
        elu[i] = elu1(x[i])
        le0[i] = exp_le0(min(x[i], x.dtype.type(0)))
        anywhere[i] = exp_any(x[i])


def main():
    assert not target_has_fma(cpu_target.target_context), cpu_target.target_context.codegen()._tm_features
    for dtype, ulps, low in ((np.float32, 1.05, -87.33), (np.float64, 1.05, -708.3)):
        x = np.concatenate([-np.logspace(-30, np.log10(-low), 20_000), np.linspace(low, 30, 20_001)]).astype(dtype)
        elu, le0, anywhere = np.empty_like(x), np.empty_like(x), np.empty_like(x)
        maps(x, elu, le0, anywhere)
        ref = exact_exp(np.minimum(x, 0))
        m = x <= 0
        for got in (elu, le0, anywhere) if dtype == np.float32 else (elu, le0):  # (float64's exp_any: libm's)
            err = np.abs(got[m] - ref[m]) / np.spacing(ref[m].astype(dtype))
            assert err.max() <= ulps, (dtype, err.max())
        assert np.all(elu[x > 0] == x[x > 0] + 1)
        y = (np.random.default_rng(0).standard_normal(4099) * 3).astype(dtype)
        far = np.zeros((4099, 8), dtype)
        far[:, 3] = y
        for name in ("elu", "softplus", "silu"):
            mp = fm.Elementwise(name).scaled(0.75)
            np.testing.assert_array_equal(mp(far[:, 3:4]), mp(y[:, None]))
    print("ok")


if __name__ == "__main__":  # (pytest imports this module for doctests: nothing runs then)
    main()
