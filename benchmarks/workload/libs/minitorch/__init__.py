"""A tiny pure-Python stand-in for an installed library (the part a trace should leave out)."""

from minitorch.tensor import Tensor, matmul, relu
from minitorch.nn import Linear, Sequential, mse

__all__ = ["Tensor", "matmul", "relu", "Linear", "Sequential", "mse"]
