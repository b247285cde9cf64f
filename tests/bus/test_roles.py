"""Role and Phase print, encode and compare as the strings the bus carries."""

from __future__ import annotations

import orjson

from splitbus.bus.roles import PHASES, ROLES, Phase, Role


def test_members_are_the_strings_on_the_bus() -> None:
    assert ROLES == ("prefill", "decode", "mixed") and PHASES == ("prefill", "decode", "mixed")
    assert Role("decode") is Role.DECODE and Phase("mixed") is Phase.MIXED
    assert Role.PREFILL == "prefill" and "prefill" == Phase.PREFILL


def test_members_print_as_their_value() -> None:
    # An f-string, str.format or JSON body must carry "prefill", never "Role.PREFILL".
    assert f"{Role.PREFILL}" == "prefill" and str(Phase.MIXED) == "mixed" and "{}".format(Role.DECODE) == "decode"  # noqa: UP032
    assert orjson.dumps({"role": Role.MIXED, "phase": Phase.DECODE}) == b'{"role":"mixed","phase":"decode"}'


def test_the_lists_print_as_the_values_in_messages() -> None:
    # "role must be one of ...": a tuple of members would print their reprs (<Role.PREFILL: ...>).
    assert f"{ROLES}" == "('prefill', 'decode', 'mixed')" and f"{PHASES}" == "('prefill', 'decode', 'mixed')"
