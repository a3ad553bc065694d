"""The connector interface: a scheduler half and a worker half, and what each half is shown.

The engine drives a connector in three phases per allocation (see ``kvtier.engine.connector_driver``):

    ask      get_num_new_matched_tokens(request, num_computed_tokens), at most once per
             allocation (again at later steps while it answers None), before residency exists;
             it must have no side effects on the engine or on the store's contents
    reserve  after the cache is resumed: capacity and history moved to the offer end in one call;
             pages that cannot be had yet keep the request waiting, its offer kept, while other
             requests run (as vLLM's waits for blocks); with none running it is handed back
    deliver  on the batch that actually runs: update_state_after_alloc exactly once, then the
             worker loads (start_load_kv / wait_for_layer_load) before the forward. An
             asynchronous load (the ask said so) may go on after that: its request computes
             nothing, while the others run, until ``get_finished`` reports the load (asked every
             step with the requests whose loads are in flight)

``build_connector_meta`` is shown the step's ``SchedulerOutput``: each request the forward computes,
with ``num_computed_tokens`` where its chunk starts (an offer loaded in the step counts as computed;
a chunk may start mid-block), its tokens in ``num_scheduled_tokens``, and ``all_token_ids`` up to
the chunk's end; a request whose asynchronous load is delivered in the step computes nothing in it
and is not listed. A synchronous load known to have failed only after the metadata is bound (a hook
raised, or a block id reported) takes its request out of the forward: that step's save hooks do not
run, so a per-step saver never stores pages nothing wrote. The save hooks come after the whole
forward: ``save_kv_layer`` for each layer in turn, then ``wait_for_save``; a page holds every layer
of its group, so a saver may copy whole pages. A step with nothing to compute still steps the
connector (build, bind, ``start_load_kv``, ``wait_for_save``, ``get_finished``) while requests ended
since the last step or saves and loads are pending, as vLLM does.

A load that fails is a miss: one reported finished but failed (``get_failed_loads``), one with a
page among ``get_block_ids_with_load_errors`` (vLLM's report: asked right after the load hooks,
by when a synchronous load's failures must be known, and after every ``get_finished``), one whose
hooks raised, or one in flight longer than ``kvtier.engine.connector_driver.ASYNC_LOAD_WAIT_S``.
Nothing of its offer is committed, the request starts over from what the engine holds, and the
connector is not asked for it again; pages an unreported load may still write stay held until
``get_finished`` reports it.

An offer that is never delivered is handed back with ``cancel_load(request, start, end)`` over
absolute token positions; so is a synchronous offer delivered in a step whose hooks raised (its
request starts over and gives up its pages): a load the connector recorded for it must be dropped
(where ``cancel_load`` raises, the pages stay held until the connector's next ``start_load_kv``
returns). The engine computes a prompt's last token itself: an offer reaches at most the token
before it, and the engine hands back the tokens offered past that at once. A sliding-window group
needs its pages at the history the offer ends at, and one token less may need one more block: an
offer cut so that its window reaches a block from the offer's start on that the window at its own
end did not is handed back whole.

``request_finished`` is called once for every request that ends, as vLLM does: finished,
aborted (running, queued, or while its load is in flight) or failed; the next step's
``SchedulerOutput.finished_request_ids`` lists it. A request without an active cache (queued,
or failed: nothing of it is saved) shows no block ids and no computed tokens. True (or vLLM's
``(True, params)``) means a save is still running: the engine keeps the request's pages (locked
in the primary tier) until ``get_finished`` reports the save done (and, aborted while loading,
the load too).

An ask answering None (vLLM's "ask again later") makes the request wait, its cache suspended,
while the requests behind it go first; it is asked again at each later step, for
``ASYNC_LOAD_WAIT_S`` at most, then runs without an offer.

Where kvtier differs from vLLM: ``update_state_after_alloc`` is called only for requests with an
offer, and without the offer's token count (the connector's own answer to the ask); a request
whose synchronous load failed is listed in its step's ``SchedulerOutput`` but computes nothing in
it (and the step saves nothing); block ids come whole, not as the blocks added since the last call.

Block ids are positional per layer group: entry i is block i, ``BAD_PAGE_INDEX`` where a block
has no page (a stale sliding-window block: a saver skips it, and a load never names it). With one
layer group, ``request.new_block_ids`` carries that group's list too (the whole list).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvtier.config import ReuseScope
from kvtier.layout import KvCacheLayout


@dataclass(slots=True)
class ConnectorRequest:
    """What a connector sees of a request.

    ``prompt_token_ids`` is the prompt; ``all_token_ids`` the prompt and every generated token
    whose KV is in the cache (in a ``SchedulerOutput``: up to the end of the chunk the step
    computes). ``block_ids_by_layer_group`` (and ``new_block_ids`` with one layer group) are the
    cache's page slots, positional and whole, as of the call they come with.
    """

    request_id: int
    prompt_token_ids: list[int]
    all_token_ids: list[int]
    scope: ReuseScope
    num_computed_tokens: int
    block_ids_by_layer_group: list[list[int]] = field(default_factory=list)
    priority: int = 35  # the request's priority (0..100), as given to the engine

    @property
    def new_block_ids(self) -> list[int]:
        """The one layer group's block ids (empty with several groups: ids are per group)."""
        return self.block_ids_by_layer_group[0] if len(self.block_ids_by_layer_group) == 1 else []


@dataclass(slots=True)
class SchedulerOutput:
    """The step as the connector's ``build_connector_meta`` sees it: the requests the forward
    computes (each from its ``num_computed_tokens`` on), their token counts, and the requests that
    ended since the last step."""

    scheduled: list[ConnectorRequest]
    num_scheduled_tokens: dict[int, int]
    finished_request_ids: list[int]


class KvCacheConnectorScheduler(ABC):
    """The half that runs beside the scheduler: offers, bookkeeping, metadata for the worker."""

    @abstractmethod
    def get_num_new_matched_tokens(self, request: ConnectorRequest, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens after ``num_computed_tokens`` the connector can supply, and whether it loads them asynchronously."""

    @abstractmethod
    def update_state_after_alloc(self, request: ConnectorRequest, block_ids_by_layer_group: list[list[int]]) -> None:
        """The offer is delivered: its blocks now have these pages (called exactly once per offer)."""

    @abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> object:
        """What the worker half needs for this step."""

    @abstractmethod
    def request_finished(self, request: ConnectorRequest, block_ids_by_layer_group: list[list[int]]) -> bool:
        """The request is done; True if a save of its pages is still running (free them later)."""

    def cancel_load(self, request: ConnectorRequest, start: int, end: int) -> None:  # noqa: B027 - optional hook
        """Tokens ``[start, end)`` offered earlier will not be loaded: release what holds them (an
        offer delivered in a step whose hooks raised included: a load recorded for it must not run)."""


class KvCacheConnectorWorker(ABC):
    """The half that runs beside the model: moves pages between the store and the KV cache."""

    @abstractmethod
    def register_kv_cache_layout(self, layout: KvCacheLayout) -> None:
        """Where the primary tier's pages are (valid while pages stay there)."""

    def bind_connector_meta(self, meta: object) -> None:
        """This step's metadata from the scheduler half."""
        self._meta = meta

    @abstractmethod
    def start_load_kv(self, stream: object) -> None:
        """Start loading the delivered blocks into their pages, ordered on ``stream``."""

    @abstractmethod
    def wait_for_layer_load(self, layer_id: int, stream: object) -> None:
        """Make ``stream`` wait until ``layer_id``'s loads have landed."""

    @abstractmethod
    def save_kv_layer(self, layer_id: int, stream: object) -> None:
        """``layer_id``'s KV for this step has been computed on ``stream``."""

    @abstractmethod
    def wait_for_save(self, stream: object) -> None:
        """The forward is done: saves may read the step's pages from here on."""

    @abstractmethod
    def get_finished(self, finished_gen_ids: Sequence[int], started_loading_ids: Sequence[int]) -> tuple[list, list]:
        """(request ids whose saves finished, request ids whose asynchronous loads finished)."""

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Block ids (primary-tier slots; slots are per layer group, and an id is taken as failed in
        every group) whose loads failed since the last call, each given once: vLLM's report of
        loads that failed without raising. An offer with a page among them is a miss (recomputed).
        Default: none."""
        return set()

    def get_failed_loads(self) -> set[int]:
        """Request ids, among the loads ``get_finished`` reported finished, whose loads failed (a page
        that never arrived intact), each given once; the engine asks right after every
        ``get_finished`` and recomputes those offers. Default: none (every load lands)."""
        return set()
