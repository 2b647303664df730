"""Op vocabularies the passes match on."""
from __future__ import annotations

# Unary elementwise ops an activation may be (equal attributes across members required).
ACTIVATIONS = {
    "Relu", "Sigmoid", "Tanh", "LeakyRelu", "Elu", "Selu", "Celu", "HardSigmoid", "HardSwish",
    "Softplus", "Softsign", "Gelu", "Erf", "Abs", "Neg", "Exp", "Log", "Sqrt", "Mish", "ThresholdedRelu",
}


# Ops the pointwise-fusion pass fuses: a Split piece read only by these is read in place.
ELEMENTWISE = ACTIVATIONS | {
    "Add", "Sub", "Mul", "Div", "Max", "Min", "Pow", "PRelu", "Where", "Clip", "Reciprocal",
    "Floor", "Ceil", "Round", "Sign", "Cast", "Not", "And", "Or", "Equal", "Less", "Greater",
    "Sin", "Cos",
}
# Ops whose outputs are views of their input: a region reads them in place.
VIEW_OPS = ("Slice", "Split")
