"""A rollout that gives up its task early (the task's `quit_early` says so) is never reinforced for it:
where its advantage is positive its last turn is left out of the loss (a sample with no turn left is not
queued); where it is not, that turn is trained (pushed down) as before. TRL's own scoring computes the
advantages."""

import multiprocessing

from tests.deltasync.trl.test_rollout import rollout_loop, running, server, tokenizer  # noqa: F401 (fixtures)
from trainer.task import quit_early


def test_an_early_quit_is_never_reinforced(server, tokenizer):  # noqa: F811
    url, _ = server  # every turn is one EOS token and no tool call: each rollout quits on its first turn
    buffer = multiprocessing.get_context("spawn").Queue()
    loop = rollout_loop(url, tokenizer, buffer, quit_early=quit_early, max_inflight_tasks=2)
    with running(loop):
        samples = [buffer.get(timeout=60) for _ in range(4)]  # groups of two: rewards 0 and 1
    # Quitting beat its group: the quit turn is out of the loss, and with it the sample's only turn, so the
    # sample is not queued. Quitting lost its group: still trained, so quitting is pushed down.
    assert [s.advantage < 0 and s.completion_mask[-1] == 1 for s in samples] == [True] * 4


def test_without_quit_early_every_last_turn_is_trained(server, tokenizer):  # noqa: F811
    url, _ = server
    buffer = multiprocessing.get_context("spawn").Queue()
    loop = rollout_loop(url, tokenizer, buffer, max_inflight_tasks=2)
    with running(loop):
        samples = [buffer.get(timeout=60) for _ in range(2)]
    assert all(sample.completion_mask[-1] == 1 for sample in samples)
