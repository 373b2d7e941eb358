"""`vllm.grpc.engine.VllmEngine` beside `kvstash.v1.Scheduler`, on the same
port: the protocol gateways such as smg (the Shepherd Model Gateway) drive
engines with, from the `smg-grpc-proto` package's generated code.

    Generate        token ids (or text) in; streamed GenerateStreamChunk
                    deltas then a GenerateComplete, or one complete
    Abort           by request ids (a gateway's client disconnected)
    the rest       what a gateway asks about the engine (vllm_info.py)

Sampling fields are mapped one by one (vllm_sampling.py); one kvstash
cannot honour (penalties, min_p, logprobs, constraints, multimodal input) is
the client's request, INVALID_ARGUMENT naming it, never silently ignored;
kv_transfer_params, which a gateway sends only when it takes the instances
for vLLM's P/D workers, is UNIMPLEMENTED. n > 1 runs n requests; the first goes
alone until its first token, so the others find its prompt's full blocks in
the prefix cache. The token that completes a stop string is the last sent,
and the request is released at once. Preemption stays invisible: a
preempted request's stream only pauses. A failure that is no domain error (a
bug) is INTERNAL, logged with its traceback (rpc_errors.maps_errors).

What Generate sends, as vLLM's own servicer does:
    chunk      one per update with tokens: the delta, its index, the prompt's
               length and its tokens found in the prefix cache
    complete   streamed: as each sequence finishes, repeating the tokens of
               the update that finished it; not streamed: all of them once
               every sequence has finished, in index order, each with all
               its tokens. matched_token_id only for a token of the
               request's stop_token_ids (not for EOS)
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

import grpc
from smg_grpc_proto import vllm_engine_pb2 as pb

from kvstash import errors
from kvstash.common import rpc_errors
from kvstash.common.ids import check_request_id
from kvstash.common.sampling import Room, SamplingParams
from kvstash.common.tokenizer import Tokenizer, encode_text
from kvstash.errors import preview
from scheduler_svc.backend import Backend, Timing
from scheduler_svc.core.outputs import RequestUpdate
from scheduler_svc.core.request import RequestStatus
from scheduler_svc.streams import RequestStream, fan_in
from scheduler_svc.vllm_info import VllmInfo
from scheduler_svc.vllm_sampling import StopStrings, children, sampling_from_vllm, stop_strings

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["VllmEngine"].full_name
FINISHED_ABORTED = RequestStatus.FINISHED_ABORTED
# How a request ended, in vLLM's words.
FINISH_REASON = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass(slots=True)
class _Family:
    """A Generate call's sequences, by request id, and whether Abort named it."""

    ids: list[str]  # none while its prompt is tokenized
    aborted: bool = False


@dataclass(slots=True)
class _Sequence:
    """One of a Generate call's n sequences, as it streams."""

    request_id: str
    timing: Timing
    sampling: SamplingParams
    stops: Sequence[str]
    tokenizer: Tokenizer
    # The text stop strings are matched in keeps special tokens' text (vLLM's
    # rule), and reads after the prompt (a word's leading space).
    keep_special_text: bool = False
    prompt_ids: Sequence[int] = ()
    stream: RequestStream | None = None  # once submitted
    output: list[int] = field(default_factory=list)
    # The tokens sent for its latest update; once it finished, those of the
    # update that finished it (the stop string's, if one did).
    last_sent: list[int] = field(default_factory=list)
    matched: str | None = None  # the stop string that ended it
    _watch: StopStrings | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        if self.stops:
            self._watch = StopStrings(self.stops, self.tokenizer.stream(
                skip_special_tokens=not self.keep_special_text, prompt_ids=self.prompt_ids))

    def take(self, event: RequestUpdate, backend: Backend) -> list[int]:
        """The event's tokens to send: those up to a stop string, none after
        one (the request is released at the match)."""
        if self.matched is not None:
            return []  # made before the stop took effect
        new = event.new_token_ids
        if self._watch is not None:
            new, self.matched = self._watch.cut(new)
            if self.matched is not None:
                with contextlib.suppress(errors.NotFound):  # finished meanwhile
                    backend.abort(self.request_id, RequestStatus.FINISHED_STOPPED)
        self.output.extend(new)
        self.last_sent = new
        return new

    def updates(self, backend: Backend) -> AsyncGenerator[RequestUpdate, None]:
        """Its updates; only its end if an Abort came before it was submitted
        (the core never had it: nothing to abort, nothing for the metrics)."""
        if self.stream is None:
            return _aborted_unsubmitted(self.request_id)
        return backend.updates(self.request_id, self.stream, self.timing)

    def complete(self, finish: RequestUpdate, num_prompt_tokens: int, streamed: bool,
                 index: int) -> pb.GenerateComplete:
        """Its GenerateComplete, from its finishing update: streamed, with the
        tokens just sent for the update that finished it (as vLLM's); not
        streamed, with all of them."""
        status = finish.finish_status
        assert status is not None
        complete = pb.GenerateComplete(
            output_ids=self.last_sent if streamed else self.output, index=index,
            finish_reason="stop" if self.matched is not None else FINISH_REASON[status],
            prompt_tokens=num_prompt_tokens, completion_tokens=len(self.output),
            cached_tokens=finish.num_cached_tokens)
        if self.matched is not None:
            complete.matched_stop_str = self.matched
        elif (status is RequestStatus.FINISHED_STOPPED and self.output
              and self.output[-1] in self.sampling.stop_token_ids and (
                  self.sampling.ignore_eos
                  or self.output[-1] not in self.tokenizer.eos_token_ids)):
            # EOS (unless ignored) ends a sequence before any stop id does:
            # vLLM names no matched token then, even one also listed.
            complete.matched_token_id = self.output[-1]
        return complete


async def _aborted_unsubmitted(request_id: str) -> AsyncGenerator[RequestUpdate, None]:
    yield RequestUpdate(request_id, [], FINISHED_ABORTED)


class VllmEngineServicer(VllmInfo):
    def __init__(self, attached: Callable[[], Backend]) -> None:
        """Serves with the backend `attached()` returns (Unavailable until the
        scheduler has one)."""
        super().__init__(attached)
        # A running Generate's request id -> its sequences (itself, for n = 1);
        # one call per request id at a time.
        self._families: dict[str, _Family] = {}

    # -- generation ---------------------------------------------------------

    @rpc_errors.maps_errors
    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        """n sequences (n > 1: request ids "<id>:<index>", seeds seed + index,
        as vLLM does), sharing the prompt's blocks through the prefix cache;
        each streamed with its index, or not streamed, all ending together."""
        arrival = time.monotonic()
        request_id = request.request_id
        check_request_id(request_id)
        backend = self._attached()
        if request_id in self._families:  # its sequences' ids need not clash
            raise errors.AlreadyExists(f"request_id {preview(request_id)} is running")
        # Known from here, so that an Abort while a long prompt is tokenized
        # (on a thread) is kept for when its sequences would be submitted.
        family = self._families[request_id] = _Family([])
        try:
            prompt = await self._prompt(request, backend)
            sampling = sampling_from_vllm(request.sampling_params,
                                          Room(len(prompt), backend.config.max_servable_len))
            stops = stop_strings(request.sampling_params)
            sequences = [
                _Sequence(child_id, Timing(arrival), child, stops, backend.tokenizer,
                          keep_special_text=not request.sampling_params.skip_special_tokens,
                          prompt_ids=prompt)
                for child_id, child in children(request_id, request.sampling_params.n, sampling)]
            family.ids = [s.request_id for s in sequences]
            await self._admit(backend, prompt, sequences, family)
            completes: list[pb.GenerateComplete] = []  # not streamed: sent at the end
            async with contextlib.aclosing(
                    fan_in([s.updates(backend) for s in sequences])) as updates:
                async for index, event in updates:
                    seq = sequences[index]
                    new = seq.take(event, backend)
                    if request.stream and new:
                        yield pb.GenerateResponse(chunk=pb.GenerateStreamChunk(
                            token_ids=new, prompt_tokens=len(prompt),
                            completion_tokens=len(new), cached_tokens=event.num_cached_tokens,
                            index=index))
                    if event.finish_status is None:
                        continue
                    complete = seq.complete(event, len(prompt), request.stream, index)
                    if request.stream:
                        yield pb.GenerateResponse(complete=complete)
                    else:
                        completes.append(complete)
            for complete in sorted(completes, key=lambda c: c.index):
                yield pb.GenerateResponse(complete=complete)
        finally:
            del self._families[request_id]

    @staticmethod
    async def _admit(backend: Backend, prompt: list[int], sequences: list[_Sequence],
                     family: _Family) -> None:
        """Submits every sequence: the first alone until its first token, when
        its prompt's full blocks are in the prefix cache for the others. One
        refused (or the call cancelled) aborts those submitted before it;
        after an Abort, those not yet submitted never are (their stream stays
        None)."""
        admitted: list[_Sequence] = []
        try:
            for seq in sequences:
                if family.aborted:
                    break
                # An Abort while it is admitted ends it there (Engine.admit).
                stream = seq.stream = await backend.admit(seq.request_id, prompt, seq.sampling)
                admitted.append(seq)
                if seq is sequences[0] and len(sequences) > 1:
                    await stream.begun.wait()
        except BaseException:
            for seq in admitted:
                with contextlib.suppress(errors.NotFound):
                    backend.abort(seq.request_id)
                backend.metrics.observe_finished(FINISHED_ABORTED, None, seq.timing.arrival, 0.0)
            raise

    @staticmethod
    async def _prompt(request: pb.GenerateRequest, backend: Backend) -> list[int]:
        if request.mm_inputs.ByteSize() or request.extra_mm_inputs or (
                request.media_refs.ByteSize()):
            raise errors.InvalidArgument(
                "multimodal inputs are not supported: kvstash serves text models")
        if request.kv_transfer_params.ByteSize() or request.HasField("kv_transfer_params_json"):
            raise errors.Unimplemented("kv_transfer_params: kvstash hands KV off itself (P/D)")
        if request.HasField("data_parallel_rank") and request.data_parallel_rank != 0:
            raise errors.InvalidArgument(
                f"data_parallel_rank {request.data_parallel_rank}: this engine has rank 0 only")
        kind = request.WhichOneof("input")
        if kind == "tokenized":
            return list(request.tokenized.input_ids)
        if kind == "text":
            return await encode_text(backend.tokenizer, request.text)
        raise errors.InvalidArgument("input is missing: set tokenized or text")

    @rpc_errors.maps_errors
    async def Abort(self, request: pb.AbortRequest,
                    context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        """Aborts those of the ids that are live; unknown ones are ignored (a
        gateway aborts what may just have finished). All are checked first:
        a bad one aborts none."""
        backend = self._attached()
        for request_id in request.request_ids:
            check_request_id(request_id)
        for request_id in request.request_ids:
            family = self._families.get(request_id)
            if family is not None:
                family.aborted = True  # for those not submitted yet
            for sequence_id in family.ids if family is not None else [request_id]:
                with contextlib.suppress(errors.NotFound):
                    backend.abort(sequence_id)
        return pb.AbortResponse()
