"""NGINX as a second data plane: the control plane's weights rendered into an nginx ``upstream``.

``render`` and ``quantise`` are pure (state in, config text out); ``applier``
is the I/O edge (validate with ``nginx -t``, swap the files, reload) and
``process`` runs or signals the nginx master. See docs/nginx.md.
"""
