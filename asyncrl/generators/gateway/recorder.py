"""One agent episode's model calls -> samples, token in, token out.

An agent program speaks text (OpenAI messages, or a raw prompt); the learner needs the exact ids
the engine sampled. The recorder keeps, for each call, the ids the engine saw and sampled, and
decides how a new call relates to the one before:

- **Merge.** A chat call whose messages are the previous call's messages, then the assistant
  message the gateway returned (content equal), then new messages, continues the same sample: the
  new messages are rendered with ``ChatRenderer.observation`` and appended after the sampled ids
  (loss mask 0, logprob 0), exactly as an environment's answer is in a multi-turn episode. A raw
  completion call merges when its prompt starts with the previous prompt and the text returned; only
  the rest is tokenized. The sampled ids are never decoded and encoded again: a round trip can
  merge or split tokens (or drop the EOS the text leaves out), and the learner would then train on
  ids the policy never sampled.
- **Split.** Anything else (a context edit, a summarised history, a changed system prompt, a switch
  between chat and raw calls, a chat template that renders earlier turns anew once more follow, as
  templates that drop past reasoning do) starts a new sample of the same episode, a *part*, whose prompt is the
  whole conversation rendered by the chat template with the generation prompt (or the raw prompt),
  tokenized once.

Each part is an ``EpisodeBuilder`` and becomes one ``Completion`` (``loss_mask``, ``turns``, the
sampled turns' own ``version_segments``, ``episode_index``, ``part`` k for the k-th part, and the
part's own ``prompt_ids``: the first part's too, which for a chat agent is the template's
rendering of its first messages, not the row's prompt; ``build_groups`` keeps any prompt that
differs from the group's on the sample).

``context_for_*`` computes a call's context without changing anything; ``add_turn`` commits it
with the sampled turn, so a call that fails or is cancelled leaves no trace.
"""

from __future__ import annotations

from dataclasses import dataclass

from asyncrl.generators.completion import Completion
from asyncrl.generators.rollouts.episode import EpisodeBuilder
from asyncrl.generators.rollouts.render import Message


@dataclass
class Context:
    """The ids a call is sampled after, and how it relates to the part being recorded."""

    ids: list[int]
    observation: list[int] | None
    """Ids appended to the current part before the turn (merge); None: a new part after ``ids``."""
    history: object
    """What the next call is compared with once this one's text is known (messages or prompt text)."""


class EpisodeRecorder:
    """The calls of one episode (see the module docstring). ``renderer``: a ``ChatRenderer`` for
    the model's chat template, None for a model without one (chat calls are then refused by the
    caller)."""

    def __init__(self, tokenizer, renderer, end_of_turn_ids: set[int]):
        self.tokenizer, self.renderer = tokenizer, renderer
        self.end_of_turn_ids = set(end_of_turn_ids)
        self.parts: list[EpisodeBuilder] = []
        self.finishes: list[str] = []
        """Each part's last turn's finish reason."""
        self._last_kind: str | None = None
        self._last_history: object = None
        self._closed = True  # the last turn ended with an end-of-turn id

    @property
    def calls(self) -> int:
        return sum(part.turns for part in self.parts)

    def context_for_chat(self, messages: list[Message]) -> Context:
        messages = [_plain(m) for m in messages]
        previous = self._last_history if self._last_kind == "chat" else None
        if previous is not None and messages[: len(previous)] == previous:
            try:
                observation = self.renderer.observation(messages[len(previous) :], turn_closed=self._closed)
            except ValueError:  # a template that renders earlier turns anew once more follow: split
                observation = None
            if observation is not None:
                return Context(self.parts[-1].context() + observation, observation, messages)
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return Context(list(self.tokenizer.encode(text, add_special_tokens=False)), None, messages)

    def context_for_text(self, prompt: str) -> Context:
        previous = self._last_history if self._last_kind == "text" else None
        if previous is not None and prompt.startswith(previous):
            observation = list(self.tokenizer.encode(prompt[len(previous) :], add_special_tokens=False))
            return Context(self.parts[-1].context() + observation, observation, prompt)
        # Special tokens as the generator adds them to a row's prompt, so an agent that sends the
        # row's prompt as it is gets the group's prompt ids.
        return Context(list(self.tokenizer.encode(prompt)), None, prompt)

    def add_turn(self, context: Context, turn: Completion) -> None:
        """Record ``turn``, sampled after ``context`` (from ``context_for_chat`` or ``context_for_text``)."""
        if context.observation is None:
            self.parts.append(EpisodeBuilder(context.ids))
            self.finishes.append("stop")
        else:
            self.parts[-1].add_observation(context.observation)
        self.parts[-1].add_turn(turn)
        self.finishes[-1] = "length" if turn.finish_reason == "length" else "stop"
        self._closed = len(turn.response_ids) > 0 and int(turn.response_ids[-1]) in self.end_of_turn_ids
        if isinstance(context.history, str):
            self._last_kind, self._last_history = "text", context.history + turn.text
        else:
            self._last_kind = "chat"
            self._last_history = list(context.history) + [{"role": "assistant", "content": turn.text}]

    def completions(self, episode_index: int) -> list[Completion]:
        """Each part as one sample, in order; each ends as its last turn did."""
        out = []
        for k, (part, finish) in enumerate(zip(self.parts, self.finishes)):
            completion = part.completion(finish)
            completion.episode_index = episode_index
            completion.part = k
            out.append(completion)
        return out


def _plain(message: Message) -> Message:
    """A message as the merge check and the template see it: role and text content only (clients
    add fields such as ``name: None`` or ``refusal: None`` when they send a reply back)."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise ValueError(f"a message must be an object with a string 'role', got {message!r:.80}")
    content = message.get("content")
    if content is None:
        content = ""
    elif isinstance(content, list):  # content parts: only text can be rendered
        if any(not isinstance(p, dict) or p.get("type") != "text" for p in content):
            raise ValueError("message content parts must all be of type 'text' (the model reads text only)")
        content = "".join(str(p.get("text", "")) for p in content)
    elif not isinstance(content, str):
        raise ValueError(f"message content must be a string or a list of text parts, got {type(content).__name__}")
    return {"role": message["role"], "content": content}
