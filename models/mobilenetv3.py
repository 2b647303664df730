"""mobilenetv3: a small MobileNetV3-style CNN (3x64x64 input, 100 classes), dynamic batch.

Written as an exporter that keeps BatchNormalization (torch.onnx.export with
training=TrainingMode.PRESERVE, tf2onnx) writes it: every Conv (no bias) is followed by a
BatchNormalization node. Inverted-residual blocks with depthwise convs (group = channels),
squeeze-excite (GlobalAveragePool, 1x1 Conv with bias, Relu, 1x1 Conv, HardSigmoid, Mul) and
residual Adds. Hard-swish appears in the three forms exporters write, in different blocks:
- the HardSwish op (opset 14+),
- x * HardSigmoid(x)              (HardSigmoid alpha=1/6, beta=0.5),
- x * Relu6(x + 3) / 6            (Add, Clip(0, 6), Mul, Div).

Regenerate: python models/mobilenetv3.py   (deterministic: seeded numpy)
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

from onnxfuse.models._build import FLOAT, GraphBuilder, run_main, tensor

NAME = "mobilenetv3"
IMAGE = 64
CLASSES = 100
SEED = 20240603

# (kernel, expanded channels, out channels, squeeze-excite, activation, stride)
# activation: "relu", "hswish" (op), "hsig_mul" (x*HardSigmoid(x)), "relu6_div" (x*Relu6(x+3)/6)
BLOCKS = [
    (3, 16, 16, True, "relu", 2),
    (3, 64, 24, False, "relu", 2),
    (3, 88, 24, False, "relu", 1),
    (5, 96, 40, True, "hsig_mul", 2),
    (5, 240, 40, True, "relu6_div", 1),
    (5, 240, 40, True, "hswish", 1),
    (5, 120, 48, True, "hsig_mul", 1),
    (5, 144, 48, True, "relu6_div", 1),
]
STEM = 16
LAST = 288
HEAD = 256
CALIBRATION_BATCH = 8


def make_divisible(v: float, divisor: int = 8) -> int:
    return max(divisor, int(v + divisor / 2) // divisor * divisor)


def build():
    b = GraphBuilder(SEED)

    def conv_bn(x, cin, cout, k, stride, groups, scope, prefix):
        # He init for the conv; BatchNorm statistics near identity so activations keep their range.
        fan_in = cin // groups * k * k
        w = b.weight(f"{prefix}.0.weight", b.normal((cout, cin // groups, k, k), np.sqrt(2.0 / fan_in)))
        y = b.op(
            "Conv", [x, w], kernel_shape=[k, k], strides=[stride, stride], pads=[k // 2] * 4, group=groups,
            dilations=[1, 1], name=f"{scope}/Conv",
        )
        scale = b.weight(f"{prefix}.1.weight", (1.0 + b.normal((cout,), 0.1)).astype(np.float32))
        bias = b.weight(f"{prefix}.1.bias", b.normal((cout,), 0.1))
        # Running statistics are placeholders here; calibrate() sets them from data.
        mean = b.weight(f"{prefix}.1.running_mean", np.zeros(cout, np.float32))
        var = b.weight(f"{prefix}.1.running_var", np.ones(cout, np.float32))
        return b.op("BatchNormalization", [y, scale, bias, mean, var], epsilon=1e-3, momentum=0.99, name=f"{scope}/BatchNormalization")

    def activation(x, kind, scope):
        if kind == "relu":
            return b.op("Relu", [x], name=f"{scope}/Relu")
        if kind == "hswish":
            return b.op("HardSwish", [x], name=f"{scope}/HardSwish")
        if kind == "hsig_mul":
            gate = b.op("HardSigmoid", [x], alpha=1.0 / 6, beta=0.5, name=f"{scope}/HardSigmoid")
            return b.op("Mul", [x, gate], name=f"{scope}/Mul")
        if kind == "relu6_div":
            shifted = b.op("Add", [x, b.const(3.0, np.float32)], name=f"{scope}/Add")
            relu6 = b.op("Clip", [shifted, b.const(0.0, np.float32), b.const(6.0, np.float32)], name=f"{scope}/Clip")
            y = b.op("Mul", [x, relu6], name=f"{scope}/Mul")
            return b.op("Div", [y, b.const(6.0, np.float32)], name=f"{scope}/Div")
        raise ValueError(kind)

    def squeeze_excite(x, channels, scope, prefix):
        squeezed = make_divisible(channels // 4)
        s = b.op("GlobalAveragePool", [x], name=f"{scope}/GlobalAveragePool")
        for n, (cin, cout) in enumerate(((channels, squeezed), (squeezed, channels))):
            w = b.weight(f"{prefix}.fc{n + 1}.weight", b.normal((cout, cin, 1, 1), np.sqrt(2.0 / cin)))
            bias = b.weight(f"{prefix}.fc{n + 1}.bias", b.normal((cout,), 0.1))
            s = b.op("Conv", [s, w, bias], kernel_shape=[1, 1], name=f"{scope}/fc{n + 1}/Conv")
            if n == 0:
                s = b.op("Relu", [s], name=f"{scope}/Relu")
        gate = b.op("HardSigmoid", [s], alpha=1.0 / 6, beta=0.5, name=f"{scope}/HardSigmoid")
        return b.op("Mul", [gate, x], name=f"{scope}/Mul")

    x = conv_bn("image", 3, STEM, 3, 2, 1, "/features.0", "features.0")
    x = activation(x, "hswish", "/features.0")
    cin = STEM
    for i, (k, expanded, cout, se, act, stride) in enumerate(BLOCKS):
        scope, prefix = f"/features.{i + 1}/block", f"features.{i + 1}.block"
        inp = x
        n = 0
        if expanded != cin:
            x = conv_bn(x, cin, expanded, 1, 1, 1, f"{scope}.{n}", f"{prefix}.{n}")
            x = activation(x, act, f"{scope}.{n}")
            n += 1
        x = conv_bn(x, expanded, expanded, k, stride, expanded, f"{scope}.{n}", f"{prefix}.{n}")
        x = activation(x, act, f"{scope}.{n}")
        n += 1
        if se:
            x = squeeze_excite(x, expanded, f"{scope}.{n}", f"{prefix}.{n}")
            n += 1
        x = conv_bn(x, expanded, cout, 1, 1, 1, f"{scope}.{n}", f"{prefix}.{n}")
        if stride == 1 and cin == cout:
            x = b.op("Add", [x, inp], name=f"/features.{i + 1}/Add")
        cin = cout
    x = conv_bn(x, cin, LAST, 1, 1, 1, f"/features.{len(BLOCKS) + 1}", f"features.{len(BLOCKS) + 1}")
    x = activation(x, "hswish", f"/features.{len(BLOCKS) + 1}")
    x = b.op("GlobalAveragePool", [x], name="/avgpool/GlobalAveragePool")
    x = b.op("Flatten", [x], axis=1, name="/Flatten")
    w1 = b.weight("classifier.0.weight", b.normal((HEAD, LAST), np.sqrt(2.0 / LAST)))
    b1 = b.weight("classifier.0.bias", b.normal((HEAD,), 0.05))
    x = b.op("Gemm", [x, w1, b1], alpha=1.0, beta=1.0, transB=1, name="/classifier/classifier.0/Gemm")
    x = b.op("HardSwish", [x], name="/classifier/classifier.1/HardSwish")
    w2 = b.weight("classifier.3.weight", b.normal((CLASSES, HEAD), 1.0 / np.sqrt(HEAD)))
    b2 = b.weight("classifier.3.bias", b.normal((CLASSES,), 0.05))
    b.op("Gemm", [x, w2, b2], alpha=1.0, beta=1.0, transB=1, name="/classifier/classifier.3/Gemm", outputs=["logits"])
    model = b.model(
        NAME,
        [tensor("image", FLOAT, ["batch", 3, IMAGE, IMAGE])],
        [tensor("logits", FLOAT, ["batch", CLASSES])],
        doc=__doc__.strip().splitlines()[0],
    )
    calibrate(model, b.rng.standard_normal((CALIBRATION_BATCH, 3, IMAGE, IMAGE)).astype(np.float32))
    onnx.checker.check_model(model, full_check=True)
    return model


def calibrate(model: onnx.ModelProto, images: np.ndarray) -> None:
    """Sets every BatchNormalization's running mean/variance to the statistics of its input on
    `images`, layer by layer, as a trained network's are: activations keep a sensible range
    through the whole stack instead of shrinking or exploding with random statistics.
    Statistics are rounded to 4 significant digits so that last-bit differences between CPUs
    running the calibration do not change the generated file."""
    import onnxruntime as ort

    inits = {t.name: t for t in model.graph.initializer}
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.intra_op_num_threads = 1
    so.log_severity_level = 3
    for node in model.graph.node:
        if node.op_type != "BatchNormalization":
            continue
        probe = onnx.ModelProto()
        probe.CopyFrom(model)
        del probe.graph.output[:]
        probe.graph.output.append(onnx.ValueInfoProto(name=node.input[0]))
        session = ort.InferenceSession(probe.SerializeToString(), so, providers=["CPUExecutionProvider"])
        (act,) = session.run(None, {"image": images})
        act = act.astype(np.float64)
        for name, value in ((node.input[3], act.mean(axis=(0, 2, 3))), (node.input[4], act.var(axis=(0, 2, 3)))):
            rounded = np.array([float(f"{v:.4g}") for v in value], dtype=np.float32)
            inits[name].CopyFrom(numpy_helper.from_array(rounded, name))


if __name__ == "__main__":
    run_main(build, NAME)
