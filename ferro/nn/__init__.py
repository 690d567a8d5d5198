"""A small reference model layer in NumPy, so ferro's parallelism can be used and tested without PyTorch.

Exact and deliberately small: every layer's backward is checked against finite
differences. It is a reference, not a deep-learning framework.

Example::

    model = nn.Sequential(nn.Linear(64, 32, rng=rng), nn.ReLU(), nn.Linear(32, 10, rng=rng))
    criterion, optimizer = nn.CrossEntropyLoss(), nn.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loss = criterion(model(x), y)
    optimizer.zero_grad()
    model.backward(criterion.backward())
    optimizer.step()
"""

from ferro.nn.batch_norm import BatchNorm1d, BatchNorm2d, BatchNorm3d
from ferro.nn.layers import CrossEntropyLoss, Linear, MSELoss, ReLU, Sequential, Tanh
from ferro.nn.module import Module, Parameter
from ferro.nn.optim import SGD, Adam, Optimizer

__all__ = ["SGD", "Adam", "BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "CrossEntropyLoss", "Linear", "MSELoss",
           "Module", "Optimizer", "Parameter", "ReLU", "Sequential", "Tanh"]
