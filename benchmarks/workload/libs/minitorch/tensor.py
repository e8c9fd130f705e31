"""Lists of lists with a few operations: many small Python calls, like a framework's dispatch."""


class Tensor:
    def __init__(self, rows):
        self.rows = rows

    @property
    def shape(self):
        return len(self.rows), len(self.rows[0])

    def map(self, fn):
        return Tensor([[fn(x) for x in row] for row in self.rows])

    def __add__(self, other):
        return Tensor([[a + b for a, b in zip(r, s)] for r, s in zip(self.rows, other.rows)])

    def __sub__(self, other):
        return Tensor([[a - b for a, b in zip(r, s)] for r, s in zip(self.rows, other.rows)])


def _dot(row, col):
    total = 0.0
    for a, b in zip(row, col):
        total += a * b
    return total


def matmul(a, b):
    cols = list(zip(*b.rows))
    return Tensor([[_dot(row, col) for col in cols] for row in a.rows])


def _relu(x):
    return x if x > 0 else 0.0


def relu(t):
    return t.map(_relu)


def synthetic(seed, n, width):
    return Tensor([[((seed + i * width + j) % 13) / 13 for j in range(width)] for i in range(n)])
