"""inferlb's ext_proc service: count tokens, predict cost per endpoint, pick where a request finishes first.

Not built yet: it arrives with the ext_proc issue. It will never import
``workers`` or ``control_plane``; the three services talk only over the wire.
"""
