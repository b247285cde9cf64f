"""A model's chat template is code: each test renders one that would run for hours or build
gigabytes, and checks it stops with ChatTemplateLimit (its request's error) within its bounds,
while what real templates use still renders as before."""

from __future__ import annotations

import pytest

from splitbus.tokenization import ChatTemplateError, ChatTemplateLimit
from splitbus.tokenization.chat_template import ChatTemplate
from splitbus.tokenization.template_bounds import RenderLimits
from tests.tokenization.test_chat_template import LLAMA3, QWEN2, SMOLLM2

LIMITS = RenderLimits(max_chars=8192, time_s=0.5)
MESSAGES = [{"role": "user", "content": "x" * 3000}]
BIG = "{% set s = 'y' * 8000 %}"  # a value just under the bound, to multiply
DOUBLE = "{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = OP %}{% endfor %}"

ATTACKS = {
    # hours of loop steps, no output
    "nested ranges": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "nested loops over the message": (
        "{% set c = messages[0].content %}{% for a in c %}{% for b in c %}{% for d in c %}{% endfor %}{% endfor %}"
        "{% endfor %}"
    ),
    "a macro's endless output": (
        "{% macro m() %}{% for i in range(100000) %}{% for j in range(100000) %}xx{% endfor %}{% endfor %}"
        "{% endmacro %}{{ m() }}"
    ),
    # one operation, gigabytes
    "string times a huge int": "{{ 'x' * 10**8 }}",
    "bytes times an int, twice": BIG + "{{ s.encode() * 1000 * 1000 }}",
    "a huge power": "{{ 7 ** 1000000000 }}",
    "doubling with ~": DOUBLE.replace("OP", "ns.s ~ ns.s"),
    "doubling with +": DOUBLE.replace("OP", "ns.s + ns.s"),
    "squaring an int": "{% set ns = namespace(n=7) %}{% for i in range(64) %}{% set ns.n = ns.n * ns.n %}{% endfor %}",
    "join filter": BIG + "{{ ([s] * 8000) | join }}",
    "join method": BIG + "{{ s.join(range(8000) | map('string')) }}",
    "join by attribute": BIG + "{% set ns = namespace(v=s) %}{{ ([ns] * 8000) | join(',', attribute='v') }}",
    "replace method": "{{ messages[0].content.replace('', 'abcdefgh') }}",
    "replace filter": "{{ messages[0].content | replace('', 'abcdefgh') }}",
    "center filter": "{{ 'x' | center(100000000) }}",
    "ljust method": "{{ 'x'.ljust(100000000) }}",
    "indent filter": "{{ messages[0].content | indent(100000) }}",
    "percent width": "{{ '%0100000000d' % 1 }}",
    "percent width from values": "{{ '%*d' % (100000000, 1) }}",
    "format filter width": "{{ '%0100000000d' | format(1) }}",
    "str.format width": "{{ '{:>100000000}'.format(1) }}",
    "str.format repeats": BIG + "{{ ('{0}' * 2000).format(s) }}",
    "tojson indent": "{{ messages | tojson(indent=100000) }}",
    "batch fill": "{{ [1] | batch(100000000, 0) | list }}",
    "translate": "{{ 'abc'.translate({97: 'x'}) }}",
    # many values kept, each in bounds
    "a macro returning copies": BIG
    + "{% macro m() %}{% for i in range(100000) %}{{ s }}{% endfor %}{% endmacro %}{{ m() }}",
    "a set block of copies": BIG + "{% set b %}{% for i in range(10000) %}{{ s }}{% endfor %}{% endset %}",
    "a list of distinct copies": (
        BIG + "{% set ns = namespace(l=[]) %}{% for i in range(100000) %}{% set ns.l = ns.l + [s ~ i] %}{% endfor %}"
    ),
    "output past the bound": "{% for i in range(100000) %}{{ messages[0].content }}{% endfor %}",
    # a list of references to one string: small, but it prints as gigabytes
    "a list of copies, printed": BIG + "{% set l = [s, s, s, s] %}{{ l * 4000 }}",
    "batch fill, listed": BIG + "{{ [1] | batch(30000, s) | list }}",
    "a namespace of copies": BIG + "{% set ns = namespace(v=[s, s, s]) %}{{ ([ns] * 10000) | string }}",
    "a list of copies, percent": BIG + "{{ '%s' % ([s, s, s],) }}{{ '%s%s%s%s%s' % ([s, s, s], 1, 2, 3, 4) }}",
    "endless recursion": "{% macro m(n) %}{{ m(n + 1) }}{% endmacro %}{{ m(0) }}",
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("source", ATTACKS.values(), ids=ATTACKS.keys())
def test_a_template_past_its_bounds_fails_with_chat_template_limit(source: str) -> None:
    template = ChatTemplate(source, {})
    with pytest.raises(ChatTemplateLimit):
        template.render(MESSAGES, LIMITS)
    # the thread is free and its next render is bounded afresh
    assert ChatTemplate(SMOLLM2, {}).render(MESSAGES, LIMITS).endswith("<|im_start|>assistant\n")


def test_lipsum_is_not_offered() -> None:  # lipsum(n) writes n paragraphs in one call
    with pytest.raises(ChatTemplateError, match="'lipsum' is undefined"):
        ChatTemplate("{{ lipsum(1000000) }}", {}).render(MESSAGES, LIMITS)


def test_real_templates_render_within_the_bounds() -> None:
    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "y" * 2000},
    ]
    for source in (SMOLLM2, QWEN2, LLAMA3):
        out = ChatTemplate(source, {"bos_token": "<s>"}).render(conversation, LIMITS)
        assert "y" * 2000 in out and "Be brief." in out


def test_what_the_checks_wrap_still_computes_as_jinja_does() -> None:
    source = (
        "{{ messages | map(attribute='role') | join(', ') }}|{{ messages | join('-', attribute='content') }}|"
        "{{ 'a,b'.split(',') | join('+') }}|{{ '%s=%03d' % ('n', 7) }}|{{ '{}:{:>3}'.format('k', 1) }}|"
        "{{ 'ab' | replace('a', 'c') }}|{{ 'x' | center(5) }}|{{ [1, 2, 3] | batch(2) | list }}|"
        "{{ 'a\nb' | indent(2) }}|{{ '%4s' | format('z') }}|{{ 'ab' ~ 1 ~ none }}|{{ 2 ** 10 }}|{{ [0] * 3 }}|"
        "{{ messages[0] | tojson(indent=2) }}"
    )
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]
    assert ChatTemplate(source, {}).render(messages, LIMITS) == (
        "user, assistant|Hi-Yo|a+b|n=007|k:  1|cb|  x  |[[1, 2], [3]]|a\n  b|   z|ab1None|1024|[0, 0, 0]|"
        '{\n  "role": "user",\n  "content": "Hi"\n}'
    )


def test_the_output_bound_is_the_callers() -> None:
    template = ChatTemplate(SMOLLM2, {})
    assert template.render(MESSAGES, RenderLimits(max_chars=4000))
    with pytest.raises(ChatTemplateLimit, match="more than 3000"):
        template.render(MESSAGES, RenderLimits(max_chars=3000))
