"""The progress record a peer publishes in the DHT (pure data: the phase and catch-up policy of
``peer/net/consensus.py`` reads it; ``peer/net/progress.py`` signs, validates and collects it).

Every value is checked strictly: records come from other peers.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, Field, StrictBool, StrictFloat, StrictInt, StrictStr

Count = Annotated[StrictInt, Field(ge=0)]


class ProgressRecord(BaseModel):
    """One peer's progress (values are checked strictly: they come from other peers)."""

    peer_id: StrictStr
    step: Count  # inner steps made
    round: Count  # rounds completed of fragment 0
    # per fragment: rounds applied and the hex digest of G after them (drift check, state donors)
    rounds: list[Count] = Field(default_factory=list, max_length=4096)
    digests: list[Annotated[StrictStr, Field(max_length=64)]] = Field(default_factory=list, max_length=4096)
    # rounds this peer is looking for a group for right now, as [fragment, round] (the phase rules, consensus.py)
    seeking: list[Annotated[list[Count], Field(min_length=2, max_length=2)]] = Field(default_factory=list,
                                                                                     max_length=64)
    tokens_per_second: Annotated[StrictFloat, Field(ge=0.0, allow_inf_nan=False)]
    client_mode: StrictBool
    time: Annotated[StrictFloat, Field(allow_inf_nan=False)]  # DHT time when written
