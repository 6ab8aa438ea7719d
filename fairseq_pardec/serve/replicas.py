"""Replicas of the same app under Ray Serve: each replica builds the server's service from the
same command line and serves :func:`serve.app.build_app`'s app unchanged (its lifespan starts the
replica's batcher). Ray routes requests across replicas; each replica batches its own.

Not ``@serve.batch``: it would gather requests in front of a batcher that batches them already.
``max_ongoing_requests`` is raised so that Ray hands a replica as many requests as its own queue
(--max-pending-rows) takes, and its limits answer the rest.
"""

from typing import List


def ray_app(argv: List[str], replicas: int = 2, max_ongoing_requests: int = None,
            num_cpus: float = None):
    """A Ray Serve application of ``replicas`` replicas of ``fairseq-pardec-serve argv``
    (``serve.run`` it), each given ``num_cpus`` of Ray's CPUs (Ray's default otherwise). Each
    replica loads the model from the same paths: on several machines, give paths every node
    can read."""
    from ray import serve

    from fairseq_pardec.serve.options import parse_args

    args = parse_args(argv)  # refused here, once, rather than in every replica
    ongoing = max_ongoing_requests or args.max_pending_rows

    def build():
        # on the replica: the model is loaded where it decodes
        from fairseq_pardec.serve.__main__ import build_service
        from fairseq_pardec.serve.app import build_app

        return build_app(build_service(parse_args(argv)))

    actor = {} if num_cpus is None else {"ray_actor_options": {"num_cpus": num_cpus}}
    deployment = serve.deployment(serve.ingress(build)(), name="fairseq_pardec",
                                  num_replicas=replicas, max_ongoing_requests=ongoing, **actor)
    return deployment.bind()
