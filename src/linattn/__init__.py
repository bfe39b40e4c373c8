"""linattn: exact, fast linear attention (Katharopoulos et al. 2020) for NumPy arrays."""
from . import dask, feature_maps, reference
from .attention import causal_linear_attention, linear_attention
from .decoding import attention_weights, step
from .gradients import causal_linear_attention_vjp, linear_attention_vjp
from .precompile import precompile
from .state import State

__version__ = "0.1.0"
__all__ = ["causal_linear_attention", "linear_attention", "step", "attention_weights", "State",
           "causal_linear_attention_vjp", "linear_attention_vjp", "precompile", "feature_maps", "dask", "reference",
           "__version__"]
