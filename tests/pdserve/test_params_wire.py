"""SamplingParams over the wire (`pdserve.serving.convert`): the token masks survive."""

from __future__ import annotations

from pdserve.engine.sampling_params import SamplingParams
from pdserve.serving.convert import params_from_pb, params_to_pb


def test_allowed_token_ids_and_bad_words_round_trip():
    p = SamplingParams(max_tokens=3, allowed_token_ids=(4, 2), bad_words_token_ids=((7,), (1, 5)))
    assert params_from_pb(params_to_pb(p)) == p
    assert params_from_pb(params_to_pb(SamplingParams())) == SamplingParams()
