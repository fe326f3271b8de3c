"""Quiver on a Ray cluster (``quiver serve --ray``): Ray Serve replicas that each run Quiver's
own repository manager, and an ingress that routes every request to a replica that holds its
model (Ray Serve's model multiplexing).

Only :mod:`quiver.rayserve.deployments` and :mod:`quiver.rayserve.launch` import Ray (the
optional extra ``quiver[ray]``); :mod:`~quiver.rayserve.routing` and
:mod:`~quiver.rayserve.forward` are plain Python, and the single-process server imports none of
this package.
"""
