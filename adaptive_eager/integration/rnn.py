"""nn.LSTM, nn.GRU and nn.RNN on neuron, computed as CPU computes them.

PyTorch's LSTM runs on CPU through oneDNN (`mkldnn_rnn_layer`, one op per layer and direction)
when its checks pass, and composes per-time-step cells on any other device: a few ulps off.
So on neuron the LSTM takes CPU's path where CPU would (this is `mkldnn_rnn` of ATen's
mkldnn/RNN.cpp in Python), and each `mkldnn_rnn_layer` runs on the device with CPU's kernel,
backward included. GRU and RNN take CPU's composition op for op (below). Anything else
(LSTM projections, which CPU composes too; a packed sequence, float16 LSTM under grad, oneDNN
off, where CPU's composition differs from the one used here) is composed by PyTorch as before:
the latter are a few ulps off CPU's (adaptive_eager/LIMITS.md).
"""
from __future__ import annotations

import torch

from ..engine.tensor import NeuronTensor
from ..config import DEVICE_TYPE

_LSTM_MODE = 2  # ideep::rnn_kind::LSTM


def _autocast() -> bool:
    return torch.is_autocast_enabled(DEVICE_TYPE)


def _autocast_layer(op, input, hx, params, *args):
    """Under neuron autocast a recurrent layer follows CUDA's policy (its cuDNN RNN is in the
    low-precision list, autocast.py): inputs, states and weights cast to the autocast dtype,
    then composed."""
    dt = torch.get_autocast_dtype(DEVICE_TYPE)

    def cast(t):
        return t.to(dt) if t.is_floating_point() else t
    with torch.autocast(DEVICE_TYPE, enabled=False):
        hx = [cast(h) for h in hx] if isinstance(hx, (list, tuple)) else cast(hx)
        return op.decompose(cast(input), hx, [cast(p) for p in params], *args)


def _cpu_uses_onednn(input, hx, params) -> bool:
    """ATen's use_mkldnn, asked of the neuron tensors as if they were CPU's."""
    if not (torch._C._get_mkldnn_enabled() and torch.backends.mkldnn.is_available()):
        return False
    if any(type(t) is not NeuronTensor for t in (input, *hx, *params)):
        return False
    dt = input.dtype
    ok = (dt == torch.float32
          or (dt == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())
          or (dt == torch.float16 and not torch.is_grad_enabled()
              and torch.ops.mkldnn._is_mkldnn_fp16_supported()))
    return ok and input.numel() != 0


def lstm(input, hx, params, has_biases, num_layers, dropout, train, bidirectional,
         batch_first):
    if _autocast():
        return _autocast_layer(torch.ops.aten.lstm.input, input, hx, params, has_biases,
                               num_layers, dropout, train, bidirectional, batch_first)
    num_directions = 2 if bidirectional else 1
    stride = 4 if has_biases else 2
    if (len(hx) != 2 or len(params) != num_layers * num_directions * stride
            or not _cpu_uses_onednn(input, hx, params)):
        return torch.ops.aten.lstm.input.decompose(
            input, hx, params, has_biases, num_layers, dropout, train, bidirectional,
            batch_first)
    x = input.transpose(0, 1) if batch_first else input
    layer_input = x.contiguous()
    h0, c0 = hx[0].contiguous(), hx[1].contiguous()
    hidden_size = h0.size(2)
    hy, cy = [], []
    for layer in range(num_layers):
        outputs = []
        for direction in range(num_directions):
            index = layer * num_directions + direction
            w = params[index * stride:(index + 1) * stride]
            b_ih = w[2] if has_biases else torch.zeros(w[0].shape, dtype=w[0].dtype,
                                                       device=w[0].device)
            b_hh = w[3] if has_biases else torch.zeros(w[1].shape, dtype=w[1].dtype,
                                                       device=w[1].device)
            out, h, c, _ = torch.ops.aten.mkldnn_rnn_layer(
                layer_input, w[0], w[1], b_ih, b_hh, h0[index], c0[index], direction > 0, [],
                _LSTM_MODE, hidden_size, num_layers, has_biases, bidirectional, batch_first,
                train)
            outputs.append(out)
            hy.append(h)
            cy.append(c)
        layer_input = outputs[0] if num_directions == 1 else torch.cat(outputs, -1)
        if dropout != 0 and train and layer < num_layers - 1:
            layer_input = torch.dropout(layer_input, dropout, True)
    output = layer_input.transpose(0, 1) if batch_first else layer_input
    return output, torch.stack(hy, 0), torch.stack(cy, 0)


# GRU and plain RNN: CPU's composition (ATen's RNN.cpp: apply_layer_stack over FullLayer /
# FullBidirectionalLayer, whose CPU branch projects the whole input sequence at once, then
# its cells step over the projections); any other device projects per time step and uses the
# fused cells.
def _gru_step(x_w, h, w_hh, b_hh):
    # ATen's GRUCell on CPU, op for op: in-place ops on the gates' strided views round as
    # CPU's do (a fresh contiguous tensor takes other vector paths: a few ulps off).
    ig = x_w.unsafe_chunk(3, 1)
    hg = torch.nn.functional.linear(h, w_hh, b_hh).unsafe_chunk(3, 1)
    reset = hg[0].add_(ig[0]).sigmoid_()
    update = hg[1].add_(ig[1]).sigmoid_()
    new = ig[2].add(hg[2].mul_(reset)).tanh_()
    return (h - new).mul_(update).add_(new)


def _simple_step(act):
    def step(x_w, h, w_hh, b_hh):
        return act(torch.nn.functional.linear(h, w_hh, b_hh).add_(x_w))
    return step


def _layer(step, x, h, w, has_biases, reverse):
    w_ih, w_hh = w[0], w[1]
    b_ih, b_hh = (w[2], w[3]) if has_biases else (None, None)
    steps = torch.nn.functional.linear(x, w_ih, b_ih).unbind(0)
    outs = []
    for x_w in (reversed(steps) if reverse else steps):
        h = step(x_w, h, w_hh, b_hh)
        outs.append(h)
    if reverse:
        outs.reverse()
    return torch.stack(outs, 0), h


def _cpu_rnn(name, step):
    op = getattr(torch.ops.aten, name).input

    def kernel(input, hx, params, has_biases, num_layers, dropout, train, bidirectional,
               batch_first):
        if _autocast():
            return _autocast_layer(op, input, hx, params, has_biases, num_layers, dropout,
                                   train, bidirectional, batch_first)
        num_directions = 2 if bidirectional else 1
        stride = 4 if has_biases else 2
        if (any(type(t) is not NeuronTensor for t in (input, hx, *params))
                or len(params) != num_layers * num_directions * stride or input.size(0) == 0
                or input.numel() == 0):
            return op.decompose(input, hx, params, has_biases, num_layers, dropout, train,
                                bidirectional, batch_first)
        x = input.transpose(0, 1) if batch_first else input
        hiddens = hx.unbind(0)
        final = []
        for layer in range(num_layers):
            outs = []
            for direction in range(num_directions):
                index = layer * num_directions + direction
                out, h = _layer(step, x, hiddens[index], params[index * stride:(index + 1) * stride],
                                has_biases, direction > 0)
                outs.append(out)
                final.append(h)
            x = outs[0] if num_directions == 1 else torch.cat(outs, outs[0].dim() - 1)
            if dropout != 0 and train and layer < num_layers - 1:
                x = torch.dropout(x, dropout, True)
        return (x.transpose(0, 1) if batch_first else x), torch.stack(final, 0)
    return kernel


gru = _cpu_rnn("gru", _gru_step)
rnn_tanh = _cpu_rnn("rnn_tanh", _simple_step(torch.tanh))
rnn_relu = _cpu_rnn("rnn_relu", _simple_step(torch.relu))


# nn.LSTMCell / nn.GRUCell: ATen's cells check `is_privateuseone()` and take the fused
# kernels on any such device (a few ulps off CPU, gradients more); on neuron they are CPU's
# composition, op for op (RNN.cpp's LSTMCell / GRUCell), as the layers above.
def lstm_cell(input, hx, w_ih, w_hh, b_ih=None, b_hh=None):
    F = torch.nn.functional
    gates = F.linear(hx[0], w_hh, b_hh).add_(F.linear(input, w_ih, b_ih))
    i, f, g, o = gates.unsafe_chunk(4, 1)
    i, f, g, o = i.sigmoid_(), f.sigmoid_(), g.tanh_(), o.sigmoid_()
    cy = (f * hx[1]).add_(i * g)
    return o * cy.tanh(), cy


def gru_cell(input, hx, w_ih, w_hh, b_ih=None, b_hh=None):
    return _gru_step(torch.nn.functional.linear(input, w_ih, b_ih), hx, w_hh, b_hh)
