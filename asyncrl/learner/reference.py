"""The frozen reference policy of the KL term, colocated in the learner or in its own process.

Both give the same thing — ``logprobs(input_ids, attention_mask, score_mask, dist,
position_ids=None) -> (B, L-1)``, the reference's log-probability of the next token at each
position ``score_mask`` marks, under the sampling distribution ``dist`` (temperature, top-k,
top-p: the same one the policy's logprobs are taken under, so the KL compares like with like), 0
elsewhere — so the trainer does not care where it runs:

- ``ColocatedReference``: a frozen copy of the starting weights inside the learner rank (no
  optimizer state), the cheapest choice when memory allows;
- ``PartitionedReference``: under ZeRO-3, the same frozen weights partitioned over the learner's
  ranks like the policy (a DeepSpeed ZeRO-3 engine without optimizer, as OpenRLHF and verl
  hold theirs), so a rank holds 1/N of the reference instead of all of it; a forward pass then
  gathers collectively, so every rank must make as many calls (``collective``; the step pads
  with filler rows, ``step.reference_logprobs``);
- ``RemoteReference``: asks a reference process (``run_reference``, role ``reference``, started
  by the controller when ``algorithm.kl.reference: process``) over ZeroMQ; the learner's memory
  then holds no second model, and the reference can sit on another device or node.

The reference runs the policy's micro batches (``micro_logprobs``): with
``learner.trainer.micro_batch_tokens`` the sequences are packed into rows
(``asyncrl.learner.packing``), sent as such with their ``position_ids`` (no attention mask: the
boundaries are read from the positions), and the answer is moved back to the padded layout, so
the reference computes no more padding than the policy's forward and its model runs the same
attention implementation (``learner.trainer.attn_implementation``).

The request/reply pair is a ``RequestClient``/``ReplyServer`` (DEALER/ROUTER): the learner blocks
on its request up to ``timeout_s`` and raises naming what it waited for; the server never blocks
and drops a reply to a learner that has gone.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np
import torch

from asyncrl.learner.batch import TrainBatch
from asyncrl.learner.config import TrainerConfig
from asyncrl.learner.logprobs import TokenDistribution, token_scores
from asyncrl.learner.packing import MicroBatchPlan, pack
from asyncrl.wire.messages import ReadyEvent, ReferenceFinal, RefLogprobs, WantRefLogprobs
from asyncrl.wire.sockets import ReplyServer, RequestClient

if TYPE_CHECKING:
    from asyncrl.learner.adapter import AdapterOffReference

log = logging.getLogger(__name__)


def load_frozen_model(model_dir: str, device, dtype: torch.dtype, attn_implementation: str = "sdpa"):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation=attn_implementation
    )
    model.config.use_cache = False
    model.eval().requires_grad_(False)
    return model.to(device, dtype)


class ColocatedReference:
    """A frozen copy of the starting weights in this process."""

    collective = False
    """A forward pass is local to the rank."""

    def __init__(
        self,
        model_dir: str,
        device,
        dtype: torch.dtype = torch.float32,
        chunk_tokens: int = 512,
        attn_implementation: str = "sdpa",
    ):
        self.model = load_frozen_model(model_dir, device, dtype, attn_implementation)
        self.chunk_tokens = chunk_tokens

    @torch.no_grad()
    def logprobs(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        score_mask: torch.Tensor,
        dist: TokenDistribution,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """(B, L-1) log pi_ref where ``score_mask`` is nonzero; packed rows come with their
        ``position_ids`` and no ``attention_mask``."""
        scores = token_scores(
            self.model,
            input_ids,
            None if position_ids is not None else attention_mask,
            score_mask,
            dist,
            position_ids=position_ids,
            chunk_tokens=self.chunk_tokens,
            entropy=False,
        )
        return scores.logprobs  # (B, L-1)


class PartitionedReference:
    """The frozen starting weights partitioned over the learner's ranks (ZeRO-3).

    Built partitioned and loaded module by module (``partitioned_load.build_causal_lm``: never
    whole on a rank), in a DeepSpeed engine with the policy's config and no optimizer, which
    gathers each module's parameters for its forward and frees them after."""

    collective = True
    """A forward pass is collective: every rank must call ``logprobs`` as often as the others."""

    def __init__(self, model_dir: str, cfg: TrainerConfig):
        from asyncrl.learner.deepspeed_setup import deepspeed_engine
        from asyncrl.learner.partitioned_load import build_causal_lm

        model = build_causal_lm(model_dir, cfg)
        model.config.use_cache = False
        model.eval().requires_grad_(False)
        self.engine = deepspeed_engine(model, None, cfg, role="reference")
        self.model = self.engine  # what ColocatedReference.logprobs runs: the engine gathers each module
        self.chunk_tokens = cfg.logits_chunk_tokens

    logprobs = ColocatedReference.logprobs  # the same scoring, collective here (every rank calls it equally)


class RemoteReference:
    """The reference policy in another process, asked per micro batch."""

    collective = False
    """Each rank asks for its own rows only."""

    def __init__(self, address: str, timeout_s: float = 60.0):
        self.client = RequestClient(address, name="learner.reference")
        self.timeout_s = timeout_s

    def logprobs(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        score_mask: torch.Tensor,
        dist: TokenDistribution,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if position_ids is not None or attention_mask is None:  # packed rows: every slot is in a row
            attention_mask = torch.ones_like(input_ids)
        request = WantRefLogprobs(
            input_ids=input_ids.cpu().numpy().astype(np.int32),
            attention_mask=attention_mask.cpu().numpy().astype(np.int8),
            score_mask=(score_mask.cpu() > 0).numpy().astype(np.int8),
            temperature=float(dist.temperature),
            top_k=int(dist.top_k),
            top_p=float(dist.top_p),
            position_ids=None if position_ids is None else position_ids.cpu().numpy().astype(np.int32),
        )
        reply = self.client.request(request, timeout=self.timeout_s)
        if reply is None or not isinstance(reply[1], RefLogprobs):
            raise TimeoutError(f"the reference process did not answer within {self.timeout_s} s")
        return torch.from_numpy(np.array(reply[1].logprobs)).to(input_ids.device)  # (B, L-1)

    def close(self) -> None:
        self.client.close()


def micro_logprobs(
    reference: ColocatedReference | PartitionedReference | RemoteReference | AdapterOffReference,
    micro: TrainBatch,
    plan: MicroBatchPlan,
    pad_id: int,
    dist: TokenDistribution,
) -> torch.Tensor:
    """(b, l-1) log pi_ref of a micro batch's response tokens, in its padded layout: its forward
    runs on the packed rows when ``plan`` packs them (the policy's plan), else on padded rows."""
    if plan.placement is None:
        return reference.logprobs(micro.input_ids, micro.attention_mask, micro.response_mask, dist)
    rows = pack(micro.input_ids, micro.attention_mask, micro.response_mask, plan, pad_id)
    packed = reference.logprobs(rows.input_ids, None, rows.score_mask, dist, position_ids=rows.position_ids)
    return rows.unpack(packed, micro.response_mask)  # (R, C-1) -> (b, l-1)


def answer(reference: ColocatedReference, body: WantRefLogprobs) -> RefLogprobs:
    """The reference process's reply to one request (packed rows when it has ``position_ids``)."""
    input_ids = torch.from_numpy(np.asarray(body.input_ids, dtype=np.int64))
    mask = torch.from_numpy(np.asarray(body.attention_mask, dtype=np.int64))
    score_mask = torch.from_numpy(np.asarray(body.score_mask, dtype=np.int64))
    positions = None if body.position_ids is None else torch.from_numpy(np.asarray(body.position_ids, dtype=np.int64))
    dist = TokenDistribution(body.temperature, body.top_k, body.top_p)
    logprobs = reference.logprobs(input_ids, mask, score_mask, dist, position_ids=positions)
    return RefLogprobs(logprobs=logprobs.cpu().numpy())


def run_reference(ctx, model_dir: str) -> None:
    """The reference process: answer logprob requests until told to stop. Its model runs the
    learner's attention implementation (``learner.trainer.attn_implementation``)."""
    torch.set_num_threads(1)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    reference = ColocatedReference(model_dir, device, attn_implementation=ctx.cfg.learner.trainer.attn_implementation)
    server = ReplyServer(ctx.endpoints.reference, name="reference.requests")
    served = 0
    ctx.emit(ReadyEvent())
    while not ctx.stop_requested():
        req = server.recv(timeout=0.1)
        if req is None or not isinstance(req[2], WantRefLogprobs):
            continue
        client, _kind, body = req
        server.reply(client, answer(reference, body), body.request_id)
        served += len(body.input_ids)
    ctx.emit(ReferenceFinal(served=served))
    server.close()
