"""A training-loop-shaped workload: a few lines of user code per step, most work in the library."""

from minitorch import Sequential, mse
from minitorch.nn import Linear, ReLU
from minitorch.tensor import synthetic


def batch(step, n=8, width=16):
    # A data-loading step of the user's own: one call into the library.
    x = synthetic(step, n, width)
    return x


def train(steps=300, width=16):
    model = Sequential(Linear(width, width, 1), ReLU(), Linear(width, width, 2), ReLU(), Linear(width, width, 3))
    losses = []
    for step in range(steps):
        x = batch(step, width=width)
        loss = mse(model(x), x)
        losses.append(loss)
    return sum(losses) / len(losses)
