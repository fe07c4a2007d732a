"""A tiny Qwen3 for CPU runs, built locally (no Hub): random weights, or warm-started to play Wordle's format.

    build_tiny_model(path)               random weights, a small ChatML tokenizer (the inference tests')
    build_tiny_model(path, wordle=True)  random weights, the Wordle tokenizer below
    build_tiny_model(path, moe=True)     random weights, a Qwen3-MoE: 8 experts, 2 per token
    ensure_tiny_model(path)              Wordle tokenizer and a short supervised pass on valid guesses; built
                                         once, then cached

head_dim 64 because vLLM's CPU attention rejects smaller heads; tied embeddings like Qwen3-0.6B. Weights are
drawn with std 0.1: at the usual 0.02 the layers barely move the residual stream and greedy decoding just
repeats the prompt's last token, whatever the weights.

The Wordle tokenizer is a byte-level BPE trained here on rendered Wordle conversations, with Qwen3's own chat
template and its markers (`<think>`, `<tool_call>`, `<tool_response>`, ...). TRL recognises the template, so
it parses tool calls and builds its training template exactly as for the real Qwen3; the warm start renders
its examples through the same calls as TRL's rollout worker, so the model learns the very token sequences it
will be asked to continue during RL. Every answer word is one token: a guess is one choice, as for a large
model. (Its 6k vocabulary makes a random model's end-of-turn token rare, so the inference tests, which let
random models generate until it, keep the small tokenizer.)
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import sys
import time
from pathlib import Path

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoTokenizer,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)
from trl.chat_template_utils import get_training_chat_template, qwen3_chat_template

from trainer.task import CHAT_TEMPLATE_KWARGS, USER_PROMPT
from wordle_env.rules import ANSWERS, PROMPT, Game

log = logging.getLogger(__name__)

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen3's added tokens that are not special: decoding keeps them, and the response parser looks for them.
MARKERS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
VOCAB_SIZE = 6144  # room for every answer word as one token: a guess is one choice among words
RECIPE = "wordle-sft-v4"  # bump when the build or the warm start changes: cached models are rebuilt
READY = "warm_start.json"  # written last: a folder without it is an unfinished build
PREFACE = "I think a good next guess is the word {word}, so let me try it.\n"
MAX_TURNS = 4  # guesses per warm-start game: TRL's default tool loop allows 3 tool calls, then one more turn
CORPUS = ["What is 2 + 3? The answer is 5.", "Guess the five-letter word: crane, slate.", "user assistant"]
# ChatML without a default system prompt: enough for apply_chat_template(add_generation_prompt=True)
CHATML_TEMPLATE = (
    "{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def default_model_dir() -> Path:
    """Where the warm-started tiny model is cached: $DELTASYNC_CACHE, else ~/.cache/deltasync."""
    root = os.environ.get("DELTASYNC_CACHE") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return Path(root) / "deltasync" / f"tiny-qwen3-{RECIPE}"


def guess_tool():
    """The tool TRL offers the model: `WordleEnv.guess`, bound to a client that never connects."""
    from wordle_env.client import WordleEnv

    return WordleEnv(base_url="http://127.0.0.1:9").guess


def tool_call_text(word: str) -> str:
    """What Qwen3 emits to call the guess tool (without the closing <|im_end|>)."""
    return f'<tool_call>\n{{"name": "guess", "arguments": {{"guess": "[{word}]"}}}}\n</tool_call>'


def wordle_conversations(
    n: int, seed: int, words: tuple[str, ...] = ANSWERS
) -> list[list[tuple[list[dict], str]]]:
    """`n` games of random valid guesses: per turn, the messages before it and the assistant's reply text.

    The messages are what TRL's rollout worker holds at that turn: the user prompt plus the environment's
    opening, then per guess the parsed assistant tool call and the tool's reply (the game's new text).
    """
    rng = random.Random(seed)
    games = []
    for _ in range(n):
        game = Game(answer=rng.choice(ANSWERS))
        messages: list[dict] = [{"role": "user", "content": USER_PROMPT + f"\n[GAME] {PROMPT}"}]
        turns = []
        for word in rng.sample(words, rng.randint(1, MAX_TURNS)):
            # Half the replies say a few words before the call, as chat models do: the model learns both, and
            # a reward for short completions (the e2e sanity reward) has one early choice to make.
            preface = PREFACE.format(word=word) if rng.random() < 0.5 else ""
            turns.append((list(messages), preface + tool_call_text(word) + "<|im_end|>"))
            move = f"[{word}]"
            call = {"type": "function", "function": {"name": "guess", "arguments": {"guess": move}}}
            messages.append({"role": "assistant", "content": preface.strip(), "tool_calls": [call]})
            reply = game.play(move).message
            messages.append(
                {"role": "tool", "name": "guess", "content": f"\n[Player 0] {move}\n[GAME] {reply}"}
            )
            if game.done:
                break
        games.append(turns)
    return games


def build_tokenizer(wordle: bool = True, seed: int = 0) -> PreTrainedTokenizerFast:
    """Byte-level BPE: trained on rendered Wordle conversations, with Qwen3's chat template (`wordle`), or
    a 320-token one trained on a few sentences, with a plain ChatML template."""
    if not wordle:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
        trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIALS, initial_alphabet=alphabet)
        tok.train_from_iterator(CORPUS * 50, trainer)
        return PreTrainedTokenizerFast(
            tokenizer_object=tok,
            eos_token="<|im_end|>",
            pad_token="<|endoftext|>",
            padding_side="left",
            chat_template=CHATML_TEMPLATE,
        )
    # Render the training text with the real template (rendering needs no vocabulary).
    blank = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.BPE()), chat_template=qwen3_chat_template
    )
    tools = [guess_tool()]
    texts = []
    for turns in wordle_conversations(100, seed):
        messages, reply = turns[-1]
        texts.append(blank.apply_chat_template(messages, tools=tools, tokenize=False) + reply)
    for marker in MARKERS:  # added tokens below: no merges wasted on their pieces
        texts = [t.replace(marker, " ") for t in texts]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    words = [f"[{w}] {w}" for w in ANSWERS] * 4  # so that each answer word becomes one token
    tok.train_from_iterator(texts + words + CORPUS * 50, trainer)
    tok.add_tokens([AddedToken(m, special=False, normalized=False) for m in MARKERS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        padding_side="left",
        chat_template=qwen3_chat_template,
    )


def build_tiny_model(
    path: str | Path,
    seed: int = 0,
    tied: bool = True,
    wordle: bool = False,
    moe: bool = False,
    expert_size: int = 64,
) -> Path:
    """Save a random bf16 Qwen3 (hidden 128, 2 layers, head_dim 64) and its tokenizer into `path`; `moe`: a
    Qwen3-MoE whose MLPs are 8 experts of intermediate size `expert_size`, 2 routed per token."""
    path = Path(path)
    hf_tok = build_tokenizer(wordle, seed)
    hf_tok.save_pretrained(path)
    torch.manual_seed(seed)
    common = dict(
        vocab_size=len(hf_tok),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=8192,
        initializer_range=0.1,
        tie_word_embeddings=tied,
        eos_token_id=hf_tok.eos_token_id,
        pad_token_id=hf_tok.pad_token_id,
        bos_token_id=None,
    )
    if moe:
        cfg = Qwen3MoeConfig(
            **common, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=expert_size
        )
        model = Qwen3MoeForCausalLM(cfg).to(torch.bfloat16)
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**common)).to(torch.bfloat16)
    model.generation_config.eos_token_id = hf_tok.eos_token_id
    model.save_pretrained(path)
    return path


def sft_examples(tokenizer, games: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """One (token ids, loss mask) per game, rendered exactly as TRL's rollout worker renders each turn.

    A game's turns pack into one sequence: TRL's training template is prefix-preserving, so each turn's prompt
    is a prefix of the next one's, and the reply sits right after it (as in TRL's clean multi-turn rows).
    Guesses are answer words the tokenizer holds as one token: the word is one choice, as for a large model.
    """
    template = get_training_chat_template(tokenizer)  # TRL swaps it in whenever tools are offered
    tools = [guess_tool()]
    words = tuple(w for w in ANSWERS if len(tokenizer.encode(w, add_special_tokens=False)) == 1)
    examples = []
    for turns in wordle_conversations(games, seed, words):
        ids: list[int] = []
        mask: list[int] = []
        for messages, reply in turns:
            prompt = tokenizer.apply_chat_template(
                messages,
                tools=tools,
                add_generation_prompt=True,
                chat_template=template,
                return_dict=False,
                **CHAT_TEMPLATE_KWARGS,
            )
            if prompt[: len(ids)] != ids:
                raise AssertionError("the training template is not prefix-preserving for this conversation")
            mask += [0] * (len(prompt) - len(ids))
            reply_ids = tokenizer.encode(reply, add_special_tokens=False)
            ids, mask = list(prompt) + reply_ids, mask + [1] * len(reply_ids)
        examples.append((ids, mask))
    return examples


def warm_start(
    path: str | Path, steps: int = 80, batch_size: int = 8, lr: float = 4e-3, seed: int = 0
) -> dict[str, float]:
    """Supervised pass on valid guesses in the tool-call format; rewrites the weights in `path` (bf16).

    Loss on the reply tokens only. Returns the losses and how many sampled replies were valid guesses. Short
    on purpose: the policy knows the format but plays ~2.4 guesses per game, so what RL teaches it (to keep
    guessing to the game's end, docs/demo.md) is the demo's visible rise; 160 steps left it ~4.3 guesses, near
    what 100 RL steps reach, and the rise then depended on the seed.
    """
    path = Path(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    examples = sft_examples(tokenizer, games=steps * batch_size // 2, seed=seed + 1)
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda i: min(1.0, (i + 1) / 10) * (1 - i / steps)
    )
    model.train()
    start, losses = time.perf_counter(), []
    for _ in range(steps):
        batch = rng.sample(examples, batch_size)
        width = max(len(ids) for ids, _ in batch)
        input_ids = torch.full((batch_size, width), tokenizer.pad_token_id)
        labels = torch.full((batch_size, width), -100)
        attention = torch.zeros((batch_size, width), dtype=torch.long)
        for row, (ids, mask) in enumerate(batch):  # right padding: positions stay 0..n-1
            input_ids[row, : len(ids)] = torch.tensor(ids)
            labels[row, : len(ids)] = torch.where(torch.tensor(mask) == 1, torch.tensor(ids), -100)
            attention[row, : len(ids)] = 1
        # Logits for the supervised positions only: the LM head over every prompt token would cost the most.
        hidden = model.model(input_ids=input_ids, attention_mask=attention).last_hidden_state[:, :-1]
        targets = labels[:, 1:]
        supervised = targets != -100
        logits = model.lm_head(hidden[supervised])
        loss = torch.nn.functional.cross_entropy(logits.float(), targets[supervised])
        loss.backward()
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    model.eval()
    first_prompt = examples[0][0][: examples[0][1].index(1)]
    stats = {
        "steps": steps,
        "seconds": time.perf_counter() - start,
        "loss_first": losses[0],
        "loss_last": sum(losses[-10:]) / len(losses[-10:]),
        "valid_guess_rate": valid_guess_rate(model, tokenizer, first_prompt),
    }
    model.to(torch.bfloat16).save_pretrained(path)
    return stats


@torch.no_grad()
def valid_guess_rate(model, tokenizer, prompt: list[int], samples: int = 16) -> float:
    """Share of sampled (temperature 1) replies to `prompt` that call `guess` with a valid bracketed word."""
    from wordle_env.rules import extract_word, invalid_reason

    ids = torch.tensor([prompt] * samples)
    torch.manual_seed(0)
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=True,
        temperature=1.0,
        top_k=0,
        max_new_tokens=40,
        pad_token_id=tokenizer.pad_token_id,
    )
    valid = 0
    for row in out[:, len(prompt) :].tolist():
        text = tokenizer.decode(row, skip_special_tokens=False)
        try:
            call = json.loads(text.split("<tool_call>", 1)[1].split("</tool_call>", 1)[0])
            word = extract_word(call["arguments"]["guess"])
        except (IndexError, ValueError, KeyError, TypeError):
            continue
        valid += call.get("name") == "guess" and invalid_reason(word, []) is None
    return valid / samples


def is_built(path: Path) -> bool:
    """Whether `path` holds a finished build of the warm-started tiny model."""
    return (Path(path) / READY).is_file()


def ensure_tiny_model(path: Path) -> Path:
    """The warm-started tiny model in `path`: built and warm-started if missing (minutes), then cached.

    Builds into a sibling folder and renames it into place, so concurrent callers never see half a model.
    """
    path = Path(path)
    if is_built(path):
        return path
    if path.exists():  # builds appear by rename only, complete: this folder is something else
        raise FileExistsError(f"{path} exists but holds no warm-started tiny model ({READY} missing)")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.build-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    log.info("building the tiny model into %s (cached for next time)", path)
    build_tiny_model(tmp, wordle=True)
    stats = warm_start(tmp)
    (tmp / READY).write_text(json.dumps({"recipe": RECIPE, **stats}, indent=1))
    try:
        tmp.rename(path)
    except OSError:  # another process finished first: use its build
        shutil.rmtree(tmp, ignore_errors=True)
        if not (path / READY).is_file():
            raise
    return path


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    if len(sys.argv) > 1 and sys.argv[1] == "--random":
        print(build_tiny_model(sys.argv[2] if len(sys.argv) > 2 else "tiny-qwen3"))
    else:
        model_dir = ensure_tiny_model(Path(sys.argv[1]) if len(sys.argv) > 1 else default_model_dir())
        print(model_dir, (model_dir / READY).read_text())
