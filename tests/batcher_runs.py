"""One model's scheduler run alone on a SimPy clock, for the tests of the simulated dynamic batcher
(tests/test_simulator.py, and beside the real server in tests/test_batcher_server.py)."""

from __future__ import annotations

import simpy

from pipelines.predict.batcher import ModelScheduler


def batches_of(arrivals: dict, execution: float = 1000,
               delay: float = 500) -> tuple[list[list], dict]:
    """Requests of one row, each named by its key, at the given µs into one instance
    (``execution`` µs an execution) that batches up to 4 with a ``delay`` µs queue delay: the
    executions' requests by name, and when each was answered."""
    env = simpy.Environment()
    batches: list[list] = []
    answered: dict = {}

    def execute(batch, _instance):
        batches.append([w.what for w in batch])
        yield env.timeout(execution)

    model = ModelScheduler(env, instances=1, execute=execute, max_batch_size=4, dynamic_batching=True,
                           max_queue_delay_us=delay)

    def client(name, at):
        yield env.timeout(at)
        yield model.submit(1, name)
        answered[name] = env.now

    for name, at in arrivals.items():
        env.process(client(name, at))
    env.run()
    return batches, answered
