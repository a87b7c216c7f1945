"""Templates (Note [Templates] in fusion/ir.py): an op's arguments as the cache sees them.
Neuron tensors become ("T", buffer index) + layout, host tensors ("H", ...), runtime scalars
("S", ...), everything else its static encoding; the buffers read and their bytes are
collected on the way. The IR side of it (static encodings, scalar positions) is fusion's."""
from __future__ import annotations

import torch

from fusion.ir import Handle, encode_static, scalar_positions, written_arguments

from .tensor import NeuronTensor
from ..errors import _generator_error, _out_of_bounds, _sparse_error
from ..config import DEVICE_TYPE

aten = torch.ops.aten


def template(eng, func, args, kwargs, scalars=None):
    """Note [Templates] in fusion/ir.py: tensors -> ("T", ...), Scalars -> ("S", ...). Every
    neuron tensor must be on `eng`'s core. `scalars`: scalar_positions(func), if known."""
    spos, snames = scalars or scalar_positions(func)
    if not kwargs:  # the common case, inlined (this runs per op): tensors, numbers, statics
        handles, where, vbytes, out, inputs = [], {}, [], [], []
        for i, a in enumerate(args):
            t = type(a)
            if t is NeuronTensor:
                out.append(_enc_tensor(a, eng, func, handles, where, vbytes))
            elif i in spos and t in _NUMBERS:  # as _Encoder.enc: a runtime scalar
                inputs.append(a)
                out.append(("S", len(inputs) - 1, t.__name__))
            elif t in _PLAIN and i not in spos:
                out.append(encode_static(a) if t is float else a)
            else:
                break
        else:
            return tuple(out), (), handles, inputs, vbytes
    e = _Encoder(eng, func)
    wpos, wnames = written_arguments(func)
    hpos, hname = _host_argument(func)
    args_t = tuple([e.enc(a, i in spos, i in wpos, i == hpos) for i, a in enumerate(args)])
    kwargs_t = tuple([(k, e.enc(v, k in snames, k in wnames, k == hname))
                      for k, v in kwargs.items()])
    return args_t, kwargs_t, e.handles, e.inputs, e.vbytes


# The argument CUDA's kernels read on the host, of any dims: the packed scalars of the
# `.Tensor` overloads of `_foreach_addcmul(_)` / `_foreach_addcdiv(_)` (a 1-D CPU tensor:
# CUDA refuses it on the device, "Expected scalars to be on CPU").
_HOST_ARGUMENT = {f"aten::_foreach_{op}{inplace}": "scalars"
                  for op in ("addcmul", "addcdiv") for inplace in ("", "_")}


def _host_argument(func) -> tuple[int | None, str | None]:
    name = _HOST_ARGUMENT.get(func._schema.name) if func._overloadname == "Tensor" else None
    if name is None:
        return None, None
    return [a.name for a in func._schema.arguments].index(name), name


_PLAIN = frozenset({int, float, bool, str, type(None)})  # static as they are
_NUMBERS = frozenset({int, float, bool, complex})


def _enc_tensor(v, eng, func, handles: list, where: dict, vbytes: list) -> tuple:
    """("T", local buffer index) + layout; collects the buffer (once) and its bytes read."""
    if v._engine is not eng:  # another core's tensor (Note [Cores] in integration/neuron.py)
        raise _two_devices(eng, v.device, func)
    h = v._handle
    li = where.get(h.uid)
    if li is None:
        layout, nbytes, extent = v._info
        if extent > h.nbytes:  # its storage was resized smaller (FSDP2's free)
            _out_of_bounds(layout[0], layout[1], layout[2], v.dtype, h.nbytes)
        li = where[h.uid] = len(handles)
        where[-1 - li] = v  # its first tensor object (keys < 0: buffer uids are > 0)
        handles.append(h)
        vbytes.append(min(h.nbytes, nbytes))
        return ("T", li) + layout
    layout, nbytes, _ = v._info
    if nbytes > vbytes[li]:
        vbytes[li] = min(h.nbytes, nbytes)
    # Note [Tensor identity]: CPU's overlap checks tell one tensor passed twice (the same
    # TensorImpl: a full overlap) from two tensors over the same memory (x and x.detach():
    # no overlap if empty, not provable if strided). Two distinct objects with one layout
    # get distinct instance numbers, so the program hands the op distinct tensors too.
    objs = where[-1 - li]
    if type(objs) is not list:  # a second use of the buffer: (object, instance) pairs now
        objs = where[-1 - li] = [(objs, 0)]
    k = next((k for o, k in objs if o is v), None)
    if k is None:
        k = sum(1 for o, _ in objs if o._info[0] == layout)
        objs.append((v, k))
    return ("T", li) + layout + ((k,) if k else ())


class _Encoder:
    """Builds a node's templates; a class, not a closure, so no reference cycle keeps the
    handles it collected (and so the values they name) alive past the call."""

    def __init__(self, eng, func):
        self.eng = eng
        self.func = func
        self.handles: list[Handle] = []
        self.where: dict[int, int] = {}
        self.inputs: list = []
        self.vbytes: list[int] = []

    def enc(self, v, scalar, written=False, host=False):
        if type(v) is NeuronTensor:
            return _enc_tensor(v, self.eng, self.func, self.handles, self.where, self.vbytes)
        if type(v) is torch.Generator:  # Note [Generators by type] in transfer.py
            raise _generator_error(v)
        if isinstance(v, torch.Tensor):
            # CUDA's rule: a host tensor only as a 0-d input (a value), never one written
            # (or as an argument CUDA's kernel reads on the host: _host_argument)
            if v.device.type != "cpu" or written or (
                    v.dim() != 0 and not host and self.func is not aten.copy_.default):
                raise foreign_tensor(self.eng, v, self.func)
            self.inputs.append(v.detach().clone())
            return ("H", len(self.inputs) - 1, str(v.dtype)[6:], tuple(v.shape))
        if scalar and isinstance(v, (int, float, bool, complex)):
            self.inputs.append(v)
            return ("S", len(self.inputs) - 1, type(v).__name__)
        if scalar and isinstance(v, (list, tuple)) and v and all(
                isinstance(x, (int, float, bool, complex)) for x in v):
            self.inputs.append(list(v))  # a Scalar[]: runtime values, keyed by types only
            return ("S", len(self.inputs) - 1, tuple(type(x).__name__ for x in v))
        if isinstance(v, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in v):
            return ("L",) + tuple(self.enc(x, scalar, written) for x in v)
        return encode_static(v)


def foreign_tensor(eng, t, func) -> Exception:
    """The error for a tensor an op cannot take: a sparse one on neuron (a sparse CSR tensor's
    `.to("neuron")` is made in C++, as a plain tensor: it was called a second device, "two
    devices, neuron:0 and neuron:0"), else CUDA's two-devices error."""
    if t.layout != torch.strided and t.device.type == DEVICE_TYPE:
        return _sparse_error(func._schema.name, t.layout)
    if func is aten.index.Tensor and t.device.type == "cpu":
        # a host tensor indexed by device indices (host indices of a device tensor are taken
        # as host arguments, never refused here): index's own check, as CUDA raises it
        return RuntimeError(f"indices should be either on cpu or on the same device as the "
                            f"indexed tensor ({t.device})")
    return _two_devices(eng, t.device, func)


def _two_devices(eng, other, func) -> RuntimeError:
    """CUDA's error for an op given tensors of two devices."""
    here = f"{DEVICE_TYPE}:{eng.index}"
    return RuntimeError(f"Expected all tensors to be on the same device, but found at least "
                        f"two devices, {here} and {other}! (in {func._schema.name}; move the "
                        f"tensor with .to('{here}'))")
