"""Feature maps phi: named elementwise maps, the literature's maps with their parameters (computed inside
the kernels), and user callables.

Every map here is a :class:`FeatureMap`: pass it (or its name, for the elementwise ones) as
``feature_map=`` to any function. Calling it on an array (..., D) returns phi of its rows, (..., D'),
with the same code the kernels run; ``out_dim(D)`` says D'. ``m.scaled(s)`` is phi(s x), for a
model's conventions (``Taylor().scaled(d ** -0.25)`` and the like).

============================  ==============================  =========================================
map                           D'                              definition
============================  ==============================  =========================================
``"elu"``                     D                               elu(x) + 1 (Katharopoulos et al. 2020)
``"relu"``                    D                               max(x, 0)
``"identity"``                D                               x
``"squared_relu"``            D                               max(x, 0)**2 (Primer)
``"gelu"``                    D                               x Phi(x), erf form (as torch's default)
``"silu"`` (``"swish"``)      D                               x sigmoid(x)
``"sigmoid"``                 D                               1 / (1 + exp(-x))
``"softplus"``                D                               log(1 + exp(x))
:class:`Taylor`               1 + D + D(D+1)/2                Based: phi(x).phi(y) = 1 + x.y/sqrt(D) + (x.y)**2/(2D)
:class:`ReBased`              D(D+1)/2                        ReBased: (gamma LN(x) + beta), squared kernel
:class:`DPFP`                 2 D nu                          Schlag et al. 2021
:class:`Performer`            m                               FAVOR+ positive random features
:class:`Hedgehog`             2 m                             softmax([2(xW+b), -2(xW+b)])
:class:`T2R`                  m                               relu(xW + b)
============================  ==============================  =========================================
"""
import math
import numbers

import numpy as np

from . import workspace
from .cpu import map_grad, mapfns, norm_grad, pair_grad, projection_grad
from .cpu.elementwise import ELU, IDENTITY, RELU


def elu_plus_one(x):
    """elu(x) + 1, computed as ``where(x > 0, x + 1, exp(x))`` so positive values don't cancel."""
    x = np.asarray(x)
    with np.errstate(over="ignore"):
        return np.where(x > 0, x + 1, np.exp(np.minimum(x, 0))).astype(x.dtype, copy=False)


def relu(x):
    """max(x, 0), keeping NaN."""
    x = np.asarray(x)
    return np.where(x > 0, x, x * 0)


def identity(x):
    """phi(x) = x."""
    return np.asarray(x)


_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))

#: The most features D' a map computed by the kernels may have: its parameter vector holds D' and its
#: feature tables' indices in the compute dtype, exact in float32 up to 2**24.
MAX_FEATURES = 2 ** 24


def _real(value, name, low=None, positive=False):
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected a real number, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value) or (positive and value <= 0) or (low is not None and value < low):
        want = "> 0" if positive else f">= {low}" if low is not None else "finite"
        raise ValueError(f"{name}: expected a finite number {want}, got {value}")
    return value


def _matrix(value, name, ndim, shape=None):
    """A finite float64 array of ``ndim`` dims (and ``shape`` where given, None for any size)."""
    try:
        arr = np.asarray(value)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{name}: expected an array of real numbers ({exc})") from None
    if arr.dtype.kind not in "fiu":  # (a complex array would lose its imaginary part, bools mean no weights)
        raise TypeError(f"{name}: expected an array of real numbers, got dtype {arr.dtype}")
    arr = np.array(arr, dtype=np.float64)
    if arr.ndim != ndim or (shape is not None and any(s is not None and s != a for s, a in zip(shape, arr.shape))):
        want = "x".join("m" if s is None else str(s) for s in shape) if shape else f"{ndim}-D"
        raise ValueError(f"{name}: expected shape ({want}), got {arr.shape}")
    if arr.size == 0:
        raise ValueError(f"{name}: expected a non-empty array, got shape {arr.shape}")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name}: expected finite values, got NaN or inf")
    arr.setflags(write=False)
    return arr


def _pair_table(pairs):
    """The tables I, J, C (concatenated) of maps whose features are products u[I] u[J] C of a vector u."""
    return np.array(pairs, np.float64).T.ravel()


def _upper_pairs(d, diag, off, first=0):
    """(i, j, c) for i <= j < d, row by row: c = ``diag`` on the diagonal, ``off`` above it."""
    return [(i, j, diag if i == j else off) for i in range(first, d) for j in range(i, d)]


class FeatureMap:
    """A feature map the kernels compute themselves (base class: use the maps below).

    Calling a map on an array of shape (..., D) returns phi of its rows, shape (..., D'), in float32
    for float32 (and float16) input, else float64.
    """

    #: kernel code (cpu/mapfns.py), set by each map
    code = None

    def __init__(self, input_scale=1.0):
        self.input_scale = _real(input_scale, "scale", positive=True)
        self._params = {}

    def out_dim(self, d):
        """D': the number of features for inputs of ``d`` features (ValueError if ``d`` does not fit)."""
        raise NotImplementedError

    def _family_params(self, d):
        """The family's parameters after (input scale, D') in the kernels' parameter vector."""
        return np.zeros(0)

    def _family_table(self, d, skip=0):
        """_family_params(d)[skip:] in float64 from the parameters' cache (a vjp's tables: building them
        again took 40-50 us a call for Taylor at D = 16)."""
        return self.params(d, np.float64)[mapfns.HEAD + skip:]

    def scaled(self, s):
        """The same map applied to ``s * x``: phi(s x) (s > 0; scales compose)."""
        s = _real(s, "scale", positive=True)
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        new.input_scale = self.input_scale * s
        new._params = {}
        return new

    def kernel_code(self):
        """The kernels' code: 0-2 for the plain elementwise maps they apply inline, else mapfns's."""
        return self.code

    def params(self, d, dtype):
        """The kernels' parameter vector for ``d`` input features, in ``dtype`` (read-only, cached)."""
        key = (d, np.dtype(dtype))
        fp = self._params.get(key)
        if fp is None:
            dk = self.out_dim(d)
            if dk > MAX_FEATURES:  # (before the family's tables, which grow with D')
                raise ValueError(f"feature_map: expected at most {MAX_FEATURES} features D' (2**24: float32 holds D' "
                                 f"and the feature tables' indices exactly up to there), got D' = {dk} from "
                                 f"{self!r} on D = {d}")
            fp = np.concatenate([[self.input_scale, dk], self._family_params(d)]).astype(dtype)
            fp.setflags(write=False)
            if len(self._params) > 8:
                self._params.clear()
            self._params[key] = fp
        return fp

    def __call__(self, x):
        x = np.asarray(x)
        if x.ndim < 1 or x.shape[-1] < 1:
            raise ValueError(f"feature_map: expected an array (..., D) with D >= 1, got shape {x.shape}")
        comp = np.dtype(np.float32) if x.dtype in (np.float16, np.float32) else np.dtype(np.float64)
        if x.dtype.kind not in "fiub":
            raise TypeError(f"feature_map: expected real numbers, got dtype {x.dtype}")
        d = x.shape[-1]
        dk = self.out_dim(d)
        rows = x.reshape(-1, d).astype(comp, copy=False)
        if rows.strides[0] % comp.itemsize or rows.strides[1] % comp.itemsize:
            rows = np.ascontiguousarray(rows)
        code = self.kernel_code()
        if code < mapfns.FIRST:  # the inline maps: as mapfns's scaled variants, scale 1
            code += mapfns.SCALED_IDENTITY
        return mapfns.apply(rows, code, self.params(d, comp), dk).reshape(x.shape[:-1] + (dk,))

    #: The names of the map's parameters (its constructor's arguments) that get gradients
    #: (:meth:`param_vjp`); none for the parameter-free maps.
    param_names = ()

    def vjp(self, x, dphi, y=None):
        """The gradient of x from that of phi(x): dphi (..., D') -> dx (..., D), in dphi's dtype (float32
        for float16, float64 for integers: as the kernels compute). ``y``, phi(x) when the caller has it
        (saves computing it again). The parameters' gradients: :meth:`param_vjp`."""
        raise NotImplementedError

    def param_vjp(self, x, dphi, y=None):
        """The gradients of the map's parameters from that of phi(x) (summed over every row of x): a
        dict by the names of :attr:`param_names`, each of its parameter's shape, in the dtype of
        :meth:`vjp`'s result; empty for a map without parameters."""
        return {}

    def _vjps(self, x, dphi, y=None):
        """(vjp, param_vjp) of the same arguments, computing what they share once."""
        return self.vjp(x, dphi, y), self.param_vjp(x, dphi, y)

    def param_values(self):
        """The map's parameters by the names of :attr:`param_names` (read-only float64 arrays); empty for
        a map without parameters."""
        return {name: getattr(self, name) for name in self.param_names}

    def with_params(self, **values):
        """The same map (its input scale and other settings) with new values for some of its parameters
        (by the names of :attr:`param_names`), checked as the constructor checks them: shapes, finite
        values. A training loop's map after each update of its weights (``linattn.torch.TrainableMap``)."""
        unknown = sorted(set(values) - set(self.param_names))
        if unknown:
            raise TypeError(f"with_params: {type(self).__name__} has no parameter {unknown[0]!r} "
                            f"(its parameters: {', '.join(self.param_names) or 'none'})")
        if not values:
            return self  # (maps do not change)
        new = type(self)(**{**self.param_values(), **values, **self._settings()})
        new.input_scale = self.input_scale
        return new

    def _settings(self):
        """The constructor's arguments other than the parameters and the input scale."""
        return {}

    def _checked(self, x, dphi):
        """(x, dphi) checked, both in the dtype the kernels compute dphi's in: float32 for float16 and
        float32, float64 for the others (integers, float64, longdouble)."""
        x, dphi = np.asarray(x), np.asarray(dphi)
        for name, arr in (("x", x), ("dphi", dphi)):
            if arr.dtype.kind not in "fiub":
                raise TypeError(f"{name}: expected real numbers, got dtype {arr.dtype}")
        if x.ndim < 1 or x.shape[-1] < 1:
            raise ValueError(f"x: expected an array (..., D) with D >= 1, got shape {x.shape}")
        want = x.shape[:-1] + (self.out_dim(x.shape[-1]),)
        if dphi.shape != want:
            raise ValueError(f"dphi: expected shape {want} (that of phi(x)), got {dphi.shape}")
        dt = np.dtype(np.float32 if dphi.dtype in (np.float16, np.float32) else np.float64)
        return x.astype(dt, copy=False), dphi.astype(dt, copy=False)

    def _prepared(self, x, dphi, y=None, need_y=True):
        """(u = scale x, dphi, y = phi(x)), checked, in the dtype of _checked; y computed when needed
        and not given."""
        x, dphi = self._checked(x, dphi)
        dt = dphi.dtype
        u = x * dt.type(self.input_scale)
        if need_y and y is None:
            y = self(x).astype(dt, copy=False)
        return u, dphi, y

    def _args(self):
        return ""

    def __repr__(self):
        scale = "" if self.input_scale == 1.0 else f".scaled({self.input_scale!r})"
        return f"{type(self).__name__}({self._args()}){scale}"


_ELEMENTWISE = {"elu": mapfns.SCALED_ELU, "relu": mapfns.SCALED_RELU, "identity": mapfns.SCALED_IDENTITY,
                "squared_relu": mapfns.SQUARED_RELU, "gelu": mapfns.GELU, "silu": mapfns.SILU,
                "swish": mapfns.SILU, "sigmoid": mapfns.SIGMOID, "softplus": mapfns.SOFTPLUS}
_INLINE = {"identity": IDENTITY, "elu": ELU, "relu": RELU}


class Elementwise(FeatureMap):
    """An elementwise map by name: "elu" (elu(x) + 1), "relu", "identity", "squared_relu", "gelu"
    (x Phi(x), erf form), "silu" (or "swish": x sigmoid(x)), "sigmoid", "softplus" (log(1 + e^x)).
    D' = D.

    Examples
    --------
    >>> import numpy as np
    >>> from linattn.feature_maps import Elementwise
    >>> Elementwise("squared_relu")(np.array([-1.0, 0.5, 2.0]))
    array([0.  , 0.25, 4.  ])
    """

    def __init__(self, name, input_scale=1.0):
        if not isinstance(name, str) or name not in _ELEMENTWISE:
            raise ValueError(f"feature_map: unknown name {name!r}; expected one of {', '.join(map(repr, NAMES))}")
        super().__init__(input_scale)
        self.name = name
        self.code = _ELEMENTWISE[name]

    def kernel_code(self):
        if self.input_scale == 1.0 and self.name in _INLINE:
            return _INLINE[self.name]
        return self.code

    def out_dim(self, d):
        return d

    def vjp(self, x, dphi, y=None):
        x, dphi = self._checked(x, dphi)  # (y: not needed, the derivative is computed from x)
        return map_grad.times_derivative(x, dphi, self.code, self.input_scale, workspace.empty(dphi.shape, dphi.dtype))

    def _args(self):
        return repr(self.name)


class Taylor(FeatureMap):
    """Based's second-order Taylor map (Arora et al. 2024): phi(x).phi(y) = 1 + x.y/sqrt(D) +
    (x.y)**2/(2D), the first three terms of exp(x.y/sqrt(D)).

    phi(x) = [1, x / D**(1/4), x_i**2 / sqrt(2D) (i = j), x_i x_j / sqrt(D) (i < j)]: the upper
    triangle of the outer product, so D' = 1 + D + D(D+1)/2 (flash-linear-attention's
    ``TaylorFeatureMap`` keeps all D**2 products, with the same kernel). Its ``BasedLinearAttention``
    scales q and k differently in its two modes; ``Taylor().scaled(s)`` reproduces either.

    Examples
    --------
    >>> import numpy as np
    >>> from linattn.feature_maps import Taylor
    >>> x, y = np.array([1.0, 2.0]), np.array([0.5, -1.0])
    >>> phi = Taylor()
    >>> phi.out_dim(2), bool(np.isclose(phi(x) @ phi(y), 1 + x @ y / np.sqrt(2) + (x @ y) ** 2 / 4))
    (6, True)
    """

    code = mapfns.TAYLOR

    def __init__(self, input_scale=1.0):
        super().__init__(input_scale)

    def out_dim(self, d):
        return 1 + d + d * (d + 1) // 2

    def vjp(self, x, dphi, y=None):
        x, dphi = self._checked(x, dphi)  # (u = [s x, 1] formed in the kernel)
        return pair_grad.pairs_vjp(x, dphi, self._family_table(x.shape[-1]), pair_grad.TAYLOR, self.input_scale)

    def _family_params(self, d):
        # u = [x, 1]: the constant 1 = u_d u_d, x_a / d**(1/4) = u_a u_d / d**(1/4), then the products
        pairs = [(d, d, 1.0)] + [(a, d, d ** -0.25) for a in range(d)]
        return _pair_table(pairs + _upper_pairs(d, 1 / math.sqrt(2 * d), 1 / math.sqrt(d)))


class ReBased(FeatureMap):
    """ReBased (Aksenov et al. 2024): y = gamma * LayerNorm(x) + beta (normalised over D with
    ``eps``, biased variance), then the squared kernel phi(x).phi(x') = (y.y')**2:
    phi(x) = [y_i**2 (i = j), sqrt(2) y_i y_j (i < j)], D' = D(D+1)/2.

    Parameters
    ----------
    gamma, beta : array_like, shape (D,)
        The norm's learned scale and shift.
    eps : float, default 1e-5
        Added to the variance (PyTorch's LayerNorm default).
    """

    code = mapfns.REBASED

    def __init__(self, gamma, beta, eps=1e-5, input_scale=1.0):
        super().__init__(input_scale)
        self.gamma = _matrix(gamma, "gamma", 1)
        self.beta = _matrix(beta, "beta", 1, self.gamma.shape)
        self.eps = _real(eps, "eps", low=0.0)

    def out_dim(self, d):
        if d != self.gamma.shape[0]:
            raise ValueError(f"feature_map: ReBased has gamma and beta for D={self.gamma.shape[0]}, "
                             f"the inputs have D={d}")
        return d * (d + 1) // 2

    def _family_params(self, d):
        return np.concatenate([[self.eps], self.gamma, self.beta, _pair_table(_upper_pairs(d, 1.0, math.sqrt(2)))])

    param_names = ("gamma", "beta")

    def _vjps(self, x, dphi, y=None):
        """(dx, {"gamma": ..., "beta": ...}): the pair map's vjp (du, the gradient of u = gamma n + beta,
        u formed as the kernels form it), then the norm's, block by block in one compiled pass over the
        rows (cpu/norm_grad.rebased_vjp)."""
        xs, dphi, _ = self._prepared(x, dphi, need_y=False)
        return self._named(*norm_grad.rebased_vjp(xs, dphi, self.params(xs.shape[-1], xs.dtype),
                                                  *self._norm_settings(xs.dtype)))

    def _vjps_of_u(self, x, du):
        """_vjps from du (..., D), the gradient of u = gamma LN(s x) + beta (in the computation's dtype):
        what the backward kernels give, its pair map's vjp made there; the norm's vjp here (its n made
        again, eps as the kernels read it, rounded to that dtype)."""
        dt = du.dtype
        xs = np.asarray(x).astype(dt, copy=False) * dt.type(self.input_scale)
        return self._named(*norm_grad.norm_vjp(xs, du, *self._norm_settings(dt)))

    def _norm_settings(self, dt):
        """gamma, eps and the input scale as the norm's vjps take them (eps rounded to ``dt``, as the kernels
        read it)."""
        return self.gamma.astype(dt), float(dt.type(self.eps)), self.input_scale

    @staticmethod
    def _named(dx, dgamma, dbeta):
        return dx, {"gamma": dgamma, "beta": dbeta}

    def vjp(self, x, dphi, y=None):
        return self._vjps(x, dphi)[0]

    def param_vjp(self, x, dphi, y=None):
        return self._vjps(x, dphi)[1]

    def _settings(self):
        return {"eps": self.eps}

    def _args(self):
        return f"gamma=<{self.gamma.shape[0]}>, beta=<{self.beta.shape[0]}>, eps={self.eps!r}"


class DPFP(FeatureMap):
    """Deterministic parameter-free projection (Schlag et al. 2021, "Linear Transformers Are Secretly
    Fast Weight Programmers"), as the authors' code defines it: r = [relu(x), relu(-x)] (2D values),
    then for nu' = 1..nu the products r * roll(r, nu'), concatenated: D' = 2 D nu, all >= 0.

    flash-linear-attention's ``DPFPFeatureMap`` builds r as [relu(x), -relu(x)] (negative features,
    and x's negative part dropped); this one follows the paper.

    Examples
    --------
    >>> import numpy as np
    >>> from linattn.feature_maps import DPFP
    >>> DPFP(nu=1)(np.array([1.0, -2.0]))  # r = [1, 0, 0, 2]; r * roll(r, 1) = r * [2, 1, 0, 0]
    array([2., 0., 0., 0.])
    """

    code = mapfns.DPFP

    def __init__(self, nu=1, input_scale=1.0):
        if isinstance(nu, (bool, np.bool_)) or not isinstance(nu, numbers.Integral):
            raise TypeError(f"nu: expected an integer >= 1, got {type(nu).__name__}")
        if nu < 1:
            raise ValueError(f"nu: expected an integer >= 1, got {nu}")
        super().__init__(input_scale)
        self.nu = int(nu)

    def out_dim(self, d):
        return 2 * d * self.nu

    def _family_params(self, d):
        n2 = 2 * d  # u = [relu(x), relu(-x)]; feature (nu' - 1) 2D + i is u_i u_{(i - nu') mod 2D}
        return _pair_table([(i, (i - nu) % n2, 1.0) for nu in range(1, self.nu + 1) for i in range(n2)])

    def vjp(self, x, dphi, y=None):
        xs, dphi, _ = self._prepared(x, dphi, need_y=False)
        return pair_grad.pairs_vjp(xs, dphi, self._family_table(xs.shape[-1]), pair_grad.DPFP, self.input_scale)

    def _args(self):
        return f"nu={self.nu}"


class _Projection(FeatureMap):
    """A map through a (D, m) matrix (and a bias of m): z = u W (+ b) with u the scaled input. Its
    gradients are compiled (cpu/projection_grad.py)."""

    def _grads(self, x, dphi, y):
        """(dx, dW, db)."""
        x, dphi = self._checked(x, dphi)
        y = self(x) if y is None else np.asarray(y)
        if y.shape != dphi.shape:
            raise ValueError(f"y: expected phi(x), of shape {dphi.shape}, got {y.shape}")
        return projection_grad.projection_vjp(self.code, x, dphi, y.astype(dphi.dtype, copy=False), self.weight,
                                              self.input_scale)

    def vjp(self, x, dphi, y=None):
        return self._grads(x, dphi, y)[0]

    def param_vjp(self, x, dphi, y=None):
        return self._named(*self._grads(x, dphi, y)[1:])

    def _vjps(self, x, dphi, y=None):
        dx, dw, db = self._grads(x, dphi, y)
        return dx, self._named(dw, db)

    def _named(self, dw, db):
        return dict(zip(self.param_names, (dw, db)))

    def _check_d(self, d):
        if d != self.weight.shape[0]:
            raise ValueError(f"feature_map: {type(self).__name__} has a weight of shape {self.weight.shape}, "
                             f"for D={self.weight.shape[0]}; the inputs have D={d}")

    def _args(self):
        return f"<{self.weight.shape[0]}x{self.weight.shape[1]}>"


class Performer(_Projection):
    """FAVOR+ positive random features (Choromanski et al. 2021, "Rethinking Attention with
    Performers"): phi(x) = exp(omega^T x - |x|**2 / 2) / sqrt(m), an unbiased estimate of the softmax
    kernel exp(x.y) as phi(x).phi(y). fast-transformers' ``Favor`` scales x by D**-0.25 first:
    ``Performer(omega).scaled(D ** -0.25)``.

    Parameters
    ----------
    omega : array_like, shape (D, m)
        The random projections (columns); see :meth:`random`.

    Notes
    -----
    exp of large arguments overflows to inf as the formula does (beyond ~88 in float32): scale
    the inputs (the D**-0.25 above) rather than feed raw activations of large norm.
    """

    code = mapfns.PERFORMER

    def __init__(self, omega, input_scale=1.0):
        super().__init__(input_scale)
        self.weight = _matrix(omega, "omega", 2)

    @classmethod
    def random(cls, d, m, *, seed=None, orthogonal=True):
        """omega of shape (d, m) with N(0, I) columns; ``orthogonal=True`` makes each block of d
        columns orthogonal, each rescaled to the norm of an independent Gaussian vector (FAVOR+'s
        orthogonal random features), from ``numpy.random.default_rng(seed)``."""
        for name, value in (("d", d), ("m", m)):  # (m: D', at most MAX_FEATURES, as params() requires)
            if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral) or value < 1:
                raise ValueError(f"{name}: expected an integer >= 1, got {value!r}")
            if value > MAX_FEATURES:
                raise ValueError(f"{name}: expected an integer <= {MAX_FEATURES} (2**24), got {value!r}")
        rng = np.random.default_rng(seed)
        if not orthogonal:
            return cls(rng.standard_normal((d, m)))
        blocks = []
        for _ in range(-(-m // d)):
            q, r = np.linalg.qr(rng.standard_normal((d, d)))
            q *= np.where(np.diag(r) < 0, -1.0, 1.0)  # signs fixed: uniformly distributed directions
            norms = np.linalg.norm(rng.standard_normal((d, d)), axis=0)
            blocks.append(q * norms)
        return cls(np.concatenate(blocks, axis=1)[:, :m])

    def out_dim(self, d):
        self._check_d(d)
        return self.weight.shape[1]

    def _family_params(self, d):
        return self.weight.ravel()

    param_names = ("omega",)

    @property
    def omega(self):
        """The projections, shape (D, m)."""
        return self.weight


class Hedgehog(_Projection):
    """Hedgehog's learned map (Zhang et al. 2024, "The Hedgehog & the Porcupine"), as in
    flash-linear-attention's ``HedgehogFeatureMap``: z = x W + b, phi(x) = softmax([2z, -2z]) over
    its 2m values; D' = 2m.

    Parameters
    ----------
    weight : array_like, shape (D, m)
    bias : array_like, shape (m,), optional (zeros)
    """

    code = mapfns.HEDGEHOG

    def __init__(self, weight, bias=None, input_scale=1.0):
        super().__init__(input_scale)
        self.weight = _matrix(weight, "weight", 2)
        m = self.weight.shape[1]
        self.bias = _matrix(np.zeros(m) if bias is None else bias, "bias", 1, (m,))

    def out_dim(self, d):
        self._check_d(d)
        return 2 * self.weight.shape[1]

    def _family_params(self, d):
        return np.concatenate([self.weight.ravel(), self.bias])

    param_names = ("weight", "bias")


class T2R(Hedgehog):
    """T2R's learned map (Kasai et al. 2021, "Finetuning Pretrained Transformers into RNNs"):
    phi(x) = relu(x W + b); D' = m.

    Parameters
    ----------
    weight : array_like, shape (D, m)
    bias : array_like, shape (m,), optional (zeros)
    """

    code = mapfns.T2R

    def out_dim(self, d):
        self._check_d(d)
        return self.weight.shape[1]


#: The names ``feature_map=`` accepts.
NAMES = tuple(_ELEMENTWISE)
_BY_NAME = {name: Elementwise(name) for name in NAMES}

#: name -> (NumPy function, kernel code) of the maps the kernels apply inline
NAMED = {
    "elu": (elu_plus_one, ELU),
    "relu": (relu, RELU),
    "identity": (identity, IDENTITY),
}
_NUMPY_BY_CODE = {code: fn for fn, code in NAMED.values()}


def as_map(feature_map):
    """The FeatureMap for a name or a map object; a callable is returned as it is.

    Raises ``ValueError`` for an unknown name and ``TypeError`` for anything else.
    """
    if isinstance(feature_map, str):
        found = _BY_NAME.get(feature_map)
        if found is None:
            raise ValueError(f"feature_map: unknown name {feature_map!r}; expected one of "
                             f"{', '.join(map(repr, NAMES))}, a linattn.feature_maps map or a callable")
        return found
    if isinstance(feature_map, FeatureMap) or callable(feature_map):
        return feature_map
    raise TypeError(f"feature_map: expected a name ({', '.join(map(repr, NAMES))}), a linattn.feature_maps map "
                    f"or a callable, got {type(feature_map).__name__}")


def resolve(feature_map):
    """``(function, kernel code, maps_first)`` for paths that apply phi before they compute: maps the
    kernels apply inline give their code (0-2) and the others IDENTITY with ``maps_first`` True and a
    function that maps an array (the map itself, or the user's callable)."""
    fmap = as_map(feature_map)
    code = fmap.kernel_code() if isinstance(fmap, FeatureMap) else IDENTITY
    if isinstance(fmap, FeatureMap) and code < mapfns.FIRST:
        return _NUMPY_BY_CODE[code], code, False
    return fmap, IDENTITY, True


def resolve_for_device(feature_map):
    """The FeatureMap of ``feature_map`` for arrays on a CUDA device (its kernels compute every
    FeatureMap themselves, cuda/maps.py); a callable is a TypeError (it maps host arrays)."""
    fmap = as_map(feature_map)
    if not isinstance(fmap, FeatureMap):
        named = ", ".join(repr(n) for n in NAMES if n != "swish")
        raise TypeError("feature_map: a callable runs on host arrays; on CUDA device arrays use "
                        f"{named} or a linattn.feature_maps map (or pass host arrays with device='cuda')")
    return fmap
