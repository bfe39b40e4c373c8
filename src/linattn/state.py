"""The state (S, Z): what carries causal linear attention from one call or step to the next, and the sums of
non-causal attention's keys."""
from typing import NamedTuple

import numpy as np

from .workspace import aligned_views


class State(NamedTuple):
    """State of causal linear attention after some positions (or of non-causal attention's keys).

    ``S`` has shape ``(..., D', Dv)`` and holds ``sum_j phi(k_j) v_j^T``; ``Z`` has shape ``(..., D')``
    and holds ``sum_j phi(k_j)``, where ``D'`` is the feature dimension after the feature map.

    Examples
    --------
    >>> import numpy as np, linattn
    >>> st = linattn.State.zeros((2, 4), 8, 16)
    >>> st.S.shape, st.Z.shape, st.S.dtype
    ((2, 4, 8, 16), (2, 4, 8), dtype('float32'))
    """

    S: np.ndarray
    Z: np.ndarray

    @classmethod
    def zeros(cls, batch_shape, d_k, d_v, dtype=np.float32):
        """A zero state for a batch: ``S`` of ``(*batch_shape, d_k, d_v)``, ``Z`` of ``(*batch_shape, d_k)``.

        ``d_k`` is the feature dimension after the feature map (D for the named maps).
        """
        from .checks import check_state_zeros_args

        batch_shape, d_k, d_v, dtype = check_state_zeros_args(batch_shape, d_k, d_v, dtype)
        # 64-byte aligned (workspace.aligned_views): step's vector loads and stores then never straddle two cache
        # lines (B1 H8 D64: 4.45 us a step against 4.7-4.8, B4 12.1 against 13.3-13.5; docs/performance.md)
        S, Z = aligned_views([batch_shape + (d_k, d_v), batch_shape + (d_k,)], dtype)
        S.fill(0)
        Z.fill(0)
        return cls(S, Z)
