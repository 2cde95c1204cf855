"""Llumnix on Kubernetes: run-time scheduling for many vLLM instances of one model.

The core package holds what the router, the operator and the simulator share: the load model
(`llumnix.load`), the scheduling policies (`llumnix.policies`), the simulator (`llumnix.sim`) and
the command line (`llumnix.cli`).
"""

__version__ = "0.1.0"
