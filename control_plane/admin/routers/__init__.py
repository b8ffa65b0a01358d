"""The admin API's routes, one router per group (FastAPI's "bigger applications" layout).

Each module's factory takes the part of the service its routes act on and the
auth dependency, and returns an ``APIRouter`` whose tags, auth and 401 answer
are set once on the router (the probes are open: no auth); ``admin.app``
includes them in the order their routes are matched and documented.
"""
