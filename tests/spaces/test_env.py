"""The Wordle Space end to end: `python spaces/env/app.py` on a loopback port, played with OpenEnv clients."""

import contextlib
import json
import sys

import pytest
import requests
from gradio_client import Client
from gradio_client.exceptions import AppError
from openenv.core.generic_client import GenericEnvClient
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from tests.helpers import REPO, post_with_length
from trainer.processes import serving
from wordle_env.client import WordleEnvClient
from wordle_env.models import WordleAction
from wordle_env.rules import PROMPT, answer_for_seed

APP = REPO / "spaces" / "env" / "app.py"
MISSES = ["crane", "slate", "doubt", "fight", "mount", "pride", "lymph"]  # valid guesses, none shares a game


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    log = tmp_path_factory.mktemp("env-space") / "server.log"
    # grace_s=0: a graceful shutdown would wait for the play page's heartbeat stream
    with serving([sys.executable, str(APP)], log, {}, timeout=60, grace_s=0) as base:
        yield base


@pytest.fixture
def env(url):
    with WordleEnvClient(base_url=url).sync() as client:
        yield client


def seed_for(answer: str) -> int:
    return next(s for s in range(100_000) if answer_for_seed(s) == answer)


def transcript(result) -> str:
    return result.observation.messages[0].content


def guess(env, word: str):
    return env.step(WordleAction(message=f"[{word}]"))


def test_a_won_game(env):
    seed = seed_for("abbey")
    opening = env.reset(seed=seed)
    assert transcript(opening) == f"\n[GAME] {PROMPT}" and (opening.reward, opening.done) == (0.0, False)
    first = guess(env, "babes")
    assert transcript(first).endswith(
        "[GAME] You submitted [babes].\nFeedback:\nB A B E S\nY Y G G X\nYou have 5 guesses left."
    )
    assert (first.reward, first.done) == (0.0, False)
    assert first.observation.metadata["reward_signals"] == {
        "wordle.greens": 0.4,
        "wordle.yellows": 0.4,
        "wordle.repetitions": 1.0,
        "wordle.correct": 0.0,
    }
    won = guess(env, "abbey")
    assert transcript(won).endswith("G G G G G\nCongratulations! You guessed the word correctly!")
    assert (won.reward, won.done) == (1.0, True)
    assert won.observation.metadata["reward_signals"]["wordle.correct"] == 1.0
    state = env.state()
    assert (state.guesses, state.step_count, state.done) == (["babes", "abbey"], 2, True)


def test_duplicate_letters_are_scored_in_two_passes(env):
    env.reset(seed=seed_for("crane"))
    assert "Feedback:\nE E R I E\nX X Y X G\n" in transcript(guess(env, "eerie"))


def test_a_lost_game_never_shows_the_answer_before_its_end(env, url):
    seed = next(s for s in range(1000) if answer_for_seed(s) not in PROMPT + " ".join(MISSES))
    answer = answer_for_seed(seed)
    seen = [
        env.reset(seed=seed).observation.model_dump_json(),
        requests.post(f"{url}/reset", json={"seed": seed}).text,
    ]
    for word in MISSES[:5]:
        result = guess(env, word)
        seen += [result.observation.model_dump_json(), env.state().model_dump_json()]
        assert (result.reward, result.done) == (0.0, False)
    assert not any(answer in text for text in seen)
    last = guess(env, MISSES[5])
    assert (last.reward, last.done) == (0.0, True)
    assert transcript(last).endswith(
        f"You have 0 guesses left.\nThe turn limit has been reached. The secret word was: **{answer}**."
    )
    with pytest.raises(RuntimeError, match="The game is over"):
        guess(env, MISSES[6])


@pytest.mark.parametrize(
    ("move", "reason"),
    [
        ("crane", "wrap your guess in square brackets"),
        ("[cranes]", "must be exactly 5 letters"),
        ("[xyzzy]", "'xyzzy' is not in the word list"),
        ("[slate]", "already guessed 'slate'"),
        ("[crâne] 日本語", "only the letters a to z"),
    ],
)
def test_invalid_moves_are_explained_and_the_second_ends_the_game(env, move, reason):
    env.reset(seed=seed_for("abbey"))
    guess(env, "slate")
    forgiven = transcript(env.step(WordleAction(message=move)))
    assert "You attempted an invalid move. Reason: " in forgiven and reason in forgiven
    # The invalid move used no guess.
    assert transcript(guess(env, "doubt")).endswith("You have 4 guesses left.")
    ended = env.step(WordleAction(message="no brackets"))
    assert (ended.reward, ended.done) == (0.0, True)
    assert "Too many invalid moves: the game is over. The secret word was: **abbey**." in transcript(ended)


def test_a_seed_replays_the_same_game(url):
    with WordleEnvClient(base_url=url).sync() as a, WordleEnvClient(base_url=url).sync() as b:
        a.reset(seed=11)
        b.reset(seed=11)
        assert [transcript(guess(a, w)) for w in MISSES[:3]] == [transcript(guess(b, w)) for w in MISSES[:3]]
        assert transcript(guess(a, answer_for_seed(11))).endswith(
            "Congratulations! You guessed the word correctly!"
        )


def test_two_sessions_never_see_each_others_state(url):
    with WordleEnvClient(base_url=url).sync() as a, WordleEnvClient(base_url=url).sync() as b:
        a.reset(seed=12)
        b.reset(seed=13)
        after_a = transcript(guess(a, "crane"))
        assert (b.state().guesses, b.state().step_count) == ([], 0)
        after_b = transcript(guess(b, "slate"))
        assert "slate" not in after_a and "crane" not in after_b
        assert (a.state().guesses, b.state().guesses) == (["crane"], ["slate"])
        assert a.state().episode_id != b.state().episode_id


def test_moves_outside_a_game_are_refused(env):
    with pytest.raises(RuntimeError, match="No game in progress: reset first"):
        guess(env, "crane")
    with pytest.raises(RuntimeError, match="seed must be a non-negative integer"):
        env.reset(seed=-1)
    env.reset()
    assert guess(env, "crane").done is False  # the session survived both errors


def test_openenvs_generic_client_plays_unchanged(url):
    with GenericEnvClient(base_url=url).sync() as client:
        client.reset(seed=3)
        result = client.step({"message": f"[{answer_for_seed(3)}]"})
    assert (result.reward, result.done) == (1.0, True)
    assert result.observation["messages"][0]["content"].endswith(
        "Congratulations! You guessed the word correctly!"
    )


def _reply(ws, message) -> dict:
    ws.send(message if isinstance(message, str | bytes) else json.dumps(message))
    return json.loads(ws.recv(timeout=10))


def test_malformed_websocket_messages_get_clear_errors_and_the_session_goes_on(url):
    ws_url = url.replace("http", "ws") + "/ws"
    with connect(ws_url) as ws:
        assert _reply(ws, "{not json")["data"]["code"] == "INVALID_JSON"
        assert _reply(ws, {"type": "launch"})["data"]["code"] == "UNKNOWN_TYPE"
        assert _reply(ws, {"type": "step"})["data"]["code"] == "VALIDATION_ERROR"
        assert _reply(ws, {"type": "reset", "data": {"seed": 4}})["type"] == "observation"
        for data in [{}, {"message": 5}, {"message": "[crane]", "extra": 1}, {"message": "x" * 5000}]:
            error = _reply(ws, {"type": "step", "data": data})
            assert (error["type"], error["data"]["code"]) == ("error", "VALIDATION_ERROR"), data
        assert "seed must be" in _reply(ws, {"type": "reset", "data": {"seed": "é"}})["data"]["message"]
        reply = _reply(ws, {"type": "step", "data": {"message": "[слово] 🙂"}})
        assert "only the letters a to z" in reply["data"]["observation"]["messages"][0]["content"]
        assert _reply(ws, {"type": "step", "data": {"message": "[crane]"}})["data"]["done"] is False

    with connect(ws_url, max_size=None) as ws:
        ws.send("x" * 1_000_000)
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=10)
        assert closed.value.rcvd.code == 1009  # message too big: only this connection closes

    with connect(ws_url) as ws:
        assert _reply(ws, {"type": "reset", "data": {}})["type"] == "observation"


# Frames that OpenEnv 0.10's /ws loop ends the session on (the app's FrameGuard answers them instead): each
# with the error code the reply must carry.
HOSTILE_FRAMES = {
    "array": ("[1, 2]", "VALIDATION_ERROR"),
    "number": ("5", "VALIDATION_ERROR"),
    "string": ('"reset"', "VALIDATION_ERROR"),
    "null": ("null", "VALIDATION_ERROR"),
    "int-over-4300-digits": ('{"type": "reset", "data": {"seed": ' + "9" * 5000 + "}}", "INVALID_JSON"),
    "deep-nesting": ("[" * 30_000 + "]" * 30_000, "INVALID_JSON"),  # past the JSON parser's recursion limit
    "deep-but-parsable": (
        '{"type": "step", "data": {"message": ' + "[" * 500 + "]" * 500 + "}}",
        "VALIDATION_ERROR",
    ),
    "binary": (b'{"type": "state"}', "INVALID_JSON"),
    "lone-surrogate": (r'{"type": "step", "data": {"message": "[\ud800]"}}', "VALIDATION_ERROR"),
}


@pytest.mark.parametrize("name", HOSTILE_FRAMES)
def test_hostile_frames_get_an_error_and_the_game_goes_on(url, name):
    frame, code = HOSTILE_FRAMES[name]
    with connect(url.replace("http", "ws") + "/ws") as ws:
        _reply(ws, {"type": "reset", "data": {"seed": seed_for("abbey")}})
        _reply(ws, {"type": "step", "data": {"message": "[crane]"}})
        error = _reply(ws, frame)
        assert (error["type"], error["data"]["code"]) == ("error", code)
        state = _reply(ws, {"type": "state"})["data"]
        assert (state["guesses"], state["step_count"]) == (["crane"], 1)  # same session, same game
        won = _reply(ws, {"type": "step", "data": {"message": "[abbey]"}})["data"]
        assert (won["reward"], won["done"]) == (1.0, True)


def test_a_frame_at_the_depth_limit_reaches_openenv(url):
    from_depth_limit = '{"type": "step", "data": {"message": ' + "[" * 29 + "]" * 29 + "}}"  # 32 levels
    with connect(url.replace("http", "ws") + "/ws") as ws:
        error = _reply(ws, from_depth_limit)
        assert (error["data"]["code"], error["data"]["errors"][0]["loc"]) == ("VALIDATION_ERROR", ["message"])
        assert _reply(ws, {"type": "reset", "data": {}})["type"] == "observation"


def test_hostile_frames_on_the_mcp_socket_get_json_rpc_errors(url):
    with connect(url.replace("http", "ws") + "/mcp") as ws:
        for frame in ["[1]", "null", "9" * 5000, b"{}"]:
            assert _reply(ws, frame)["error"]["code"] in (-32700, -32600)  # parse error, invalid request
        listed = _reply(ws, {"jsonrpc": "2.0", "method": "tools/list", "id": 1})
        assert listed["id"] == 1


@pytest.mark.parametrize("episode_id", [5, 1.5, True, ["a"], {"id": "a"}])
def test_a_reset_with_a_non_string_episode_id_is_refused_and_state_still_works(env, episode_id):
    env.reset(seed=seed_for("abbey"), episode_id="game-1")
    guess(env, "crane")
    with pytest.raises(RuntimeError, match="episode_id must be a string"):
        env.reset(episode_id=episode_id)
    state = env.state()
    assert (state.episode_id, state.guesses) == ("game-1", ["crane"])  # the refused reset changed nothing
    assert guess(env, "abbey").reward == 1.0


def test_malformed_http_requests_get_4xx(url):
    post = requests.post
    assert post(f"{url}/step", data="{bad", headers={"content-type": "application/json"}).status_code == 422
    assert post(f"{url}/step", json={}).status_code == 422
    assert post(f"{url}/step", json={"action": {"message": "[crane]", "extra": 1}}).status_code == 422
    assert post(f"{url}/reset", json={"seed": "é"}).status_code == 422
    assert post(f"{url}/step", json={"action": {"message": "x" * 100_000}}).status_code == 413
    assert post(f"{url}/step", data=iter([b'{"action": ', b"{}}"])).status_code == 411  # chunked: no length
    for length, status in [("abc", 400), ("-1", 400), ("2, 2", 400), (str(10 << 20), 413)]:
        assert post_with_length(url, "/step", length) == status, length
    refused = post(f"{url}/step", json={"action": {"message": "[crane]"}})
    assert refused.status_code == 409 and "WebSocket" in refused.json()["detail"]
    reset = post(f"{url}/reset", json={"seed": 1})
    assert reset.ok and reset.json()["observation"]["messages"][0]["content"] == f"\n[GAME] {PROMPT}"
    schema = requests.get(f"{url}/schema").json()
    assert "message" in schema["action"]["properties"] and "messages" in schema["observation"]["properties"]
    assert requests.get(f"{url}/health").ok


def test_the_play_page_is_the_front_page(url):
    page = requests.get(f"{url}/")
    assert page.ok and "text/html" in page.headers["content-type"]
    client = Client(f"{url}/", verbose=False)
    try:
        with pytest.raises(AppError, match="The seed must be a whole number"):
            client.predict("twenty", api_name="/new_game")
        _, message, _ = client.predict("21", api_name="/new_game")
        board, message, typed = client.predict(answer_for_seed(21), api_name="/play")
    finally:
        client.close()
    assert message.endswith("Congratulations! You guessed the word correctly!") and typed == ""
    assert board.count('class="tile G"') == 5


def test_idle_sockets_are_closed_and_their_sessions_freed(tmp_path):
    log = tmp_path / "server.log"
    env = {"MAX_CONCURRENT_ENVS": "2", "SESSION_IDLE_S": "1"}
    with serving([sys.executable, str(APP)], log, env, timeout=60, grace_s=0) as base:
        ws_url = base.replace("http", "ws") + "/ws"
        with contextlib.ExitStack() as stack:
            idle = [stack.enter_context(connect(ws_url)) for _ in range(2)]  # all the sessions there are
            for ws in idle:
                with pytest.raises(ConnectionClosed) as closed:
                    ws.recv(timeout=30)
                assert (closed.value.rcvd.code, closed.value.rcvd.reason) == (1000, "idle for 1 s")
        with connect(ws_url) as ws:  # the slots are free again
            assert _reply(ws, {"type": "reset", "data": {"seed": 1}})["type"] == "observation"
            assert _reply(ws, {"type": "step", "data": {"message": "[crane]"}})["type"] == "observation"
        assert f"Wordle env listening on 127.0.0.1:{base.rsplit(':', 1)[1]}" in log.read_text()  # one line
