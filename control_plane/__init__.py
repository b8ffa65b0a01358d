"""inferlb's xDS control plane: telemetry -> weights -> xDS snapshots for Envoy and ext_proc.

Not built yet: it arrives with the control-plane issue. It will never import
``workers`` or ``ext_proc``; the three services talk only over the wire.
"""
