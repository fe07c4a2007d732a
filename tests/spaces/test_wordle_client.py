"""The trainer's Wordle client: TRL's view of it (tools, schema, pickling) and full games on the server."""

import inspect
import pickle
from functools import partial

import pytest
from openenv.core.client_types import StepResult
from openenv.core.env_server.http_server import create_app
from transformers.utils import get_json_schema

from trainer.processes import serving_in_thread
from wordle_env.client import WordleEnv
from wordle_env.environment import WordleEnvironment
from wordle_env.models import WordleAction, WordleMessage, WordleObservation, WordleState
from wordle_env.rules import answer_for_seed


@pytest.fixture(scope="module")
def url():
    """The OpenEnv server of the Space (without its page), in this process on a free loopback port."""
    app = create_app(
        WordleEnvironment, WordleAction, WordleObservation, max_concurrent_envs=4, state_cls=WordleState
    )
    with serving_in_thread(app) as url:
        yield url


def test_trl_finds_one_tool_guess_with_a_schema():
    # TRL offers as tools the public functions of the class other than reset and get_reward.
    tools = [n for n, _ in inspect.getmembers(WordleEnv, inspect.isfunction) if not n.startswith("_")]
    assert sorted(tools) == ["get_reward", "guess", "reset"]
    schema = get_json_schema(WordleEnv(base_url="http://127.0.0.1:9").guess)  # no connection until first use
    assert schema["function"]["name"] == "guess"
    assert schema["function"]["parameters"]["properties"]["guess"]["type"] == "string"
    assert schema["function"]["parameters"]["required"] == ["guess"]


def test_the_factory_pickles_for_async_grpo():
    factory = pickle.loads(pickle.dumps(partial(WordleEnv, base_url="http://127.0.0.1:9")))
    assert isinstance(factory(), WordleEnv)


def test_a_rollout_plays_a_whole_game_and_keeps_the_reward(url):
    env = WordleEnv(base_url=url)
    for seed in (5, 6):  # TRL reuses environments: a second reset starts clean
        assert env.reset(seed=seed).startswith("\n[GAME] You are Playing Wordle.")
        assert (env.reward, env.done) == (0.0, False)
        feedback = env.guess("[crane]" if answer_for_seed(seed) != "crane" else "[slate]")
        assert feedback.startswith("\n[Player 0] [") and "\nFeedback:\n" in feedback
        assert feedback.endswith("You have 5 guesses left.")
        assert "You attempted an invalid move" in env.guess("crane")
        assert (env.get_reward(), env.done) == (0.0, False)
        assert env.guess(f"[{answer_for_seed(seed)}]").endswith(
            "Congratulations! You guessed the word correctly!"
        )
        assert (env.reward, env.get_reward(), env.done) == (1.0, 1.0, True)
        with pytest.raises(ValueError, match="The game is over"):
            env.guess("[slate]")


def test_an_unseeded_reset_accepts_trls_dataset_columns(url):
    env = WordleEnv(base_url=url)
    assert "Enter your guess to begin." in env.reset(prompt=[{"role": "user", "content": "Play Wordle"}])


class RepeatsLastReward:
    """A stand-in for OpenEnv's TextArena server, which repeats the last reward after an invalid move."""

    def step(self, action):
        text = f"\n[Player 0] {action.message}\n[GAME] You attempted an invalid move. Reason: ..."
        message = WordleMessage(sender_id=-1, content=text, category="MESSAGE")
        observation = WordleObservation(prompt="", messages=[message])
        return StepResult(observation=observation, reward=0.6, done=False)


def test_an_invalid_move_earns_nothing_even_where_the_server_repeats_the_last_reward():
    env = WordleEnv(base_url="http://127.0.0.1:9")
    env._client = RepeatsLastReward()
    env.guess("crane")
    assert env.reward == 0.0
