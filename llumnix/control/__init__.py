"""The per-service control loop shared by local mode and the operator (migration pairing, autoscaling
with drain-by-migration, replacement of dead instances) and the instance-backend interface it drives."""
