"""inferlb's ext_proc service (``python -m ext_proc``): count each request's tokens,
predict its cost on every endpoint, and pick the one where it finishes first.

An Envoy external processor on 127.0.0.1:9002 and an xDS (EDS) client of the
control plane. It never imports ``workers`` or ``control_plane``; the three
services talk only over the wire.
"""
