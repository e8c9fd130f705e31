"""Modules built on minitorch.tensor."""

from minitorch.tensor import Tensor, matmul, relu


class Linear:
    def __init__(self, n_in, n_out, seed=0):
        self.weight = Tensor([[((i * 7 + j * 3 + seed) % 11 - 5) / 10 for j in range(n_out)] for i in range(n_in)])

    def __call__(self, x):
        return self.forward(x)

    def forward(self, x):
        return matmul(x, self.weight)


class ReLU:
    def __call__(self, x):
        return relu(x)


class Sequential:
    def __init__(self, *layers):
        self.layers = layers

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def mse(pred, target):
    diff = pred - target
    return sum(v * v for row in diff.rows for v in row) / (len(diff.rows) * len(diff.rows[0]))
