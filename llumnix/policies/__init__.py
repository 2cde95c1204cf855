"""Scheduling policies: pure functions over load snapshots (`llumnix.load`).

- `dispatch`: where a new request goes.
- `migration`: which instances exchange requests, and which request moves.
- `autoscaling`: when to add an instance, and which one to drain and release.

The router, the operator's control loop and the simulator all import these; see README.md here.
"""
