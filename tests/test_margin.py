"""The learned margin (dlfp/margin.py) on its own: what it answers from the steps it holds."""
import pytest

from dlfp.margin import MARGIN_SAMPLES, Margin, Measured


def chunk(ratio: float, decodes: int = 1, tokens: int = 8, itls: int = 1) -> Measured:
    return Measured(decodes, tokens, ratio, itls, late=False)


def test_the_prior_until_enough_chunk_steps_are_measured():
    m = Margin(quantile=0.99, window=128, prior=1.5)
    for _ in range(MARGIN_SAMPLES - 1):
        m.add(chunk(1.1))
    m.add(Measured(1, 0, None, 1, late=False))  # a decode-only step gives no ratio
    assert m.of(1) == 1.5
    m.add(chunk(1.1))
    assert m.of(1) == pytest.approx(1.1)


def test_steps_that_end_more_itls_weigh_more():
    m = Margin(quantile=0.9, window=128, prior=1.5)
    for _ in range(MARGIN_SAMPLES - 1):
        m.add(chunk(1.0))
    m.add(chunk(2.0, itls=1))
    assert m.of(1) == 1.0  # one step in 32: inside the 10 % let run over
    m.add(chunk(2.0, itls=8))  # ends eight chats' ITLs: 9 of 40 ITLs run at 2.0
    assert m.of(1) == 2.0


def test_the_latest_ratio_needs_every_latest_step_to_carry_prompt_tokens():
    m = Margin(quantile=0.99, window=128, prior=1.5)
    for r in (0.5, 0.6, 0.7):
        m.add(chunk(r))
    assert m.latest_ratio(3) == pytest.approx(0.6) and m.latest_ratio(4) is None
    m.add(Measured(1, 0, None, 1, late=False))
    assert m.latest_ratio(3) is None


def test_rescaling_divides_every_ratio_and_keeps_decode_only_steps():
    m = Margin(quantile=0.99, window=4, prior=1.5)
    m.add(chunk(0.6))
    m.add(Measured(2, 0, None, 2, late=True))
    m.rescale(0.6)
    assert [s.ratio for s in m.steps] == [pytest.approx(1.0), None] and m.steps.maxlen == 4


def test_learned_counts_chunk_steps_since_the_margin_began_not_what_the_window_keeps():
    m = Margin(0.99, MARGIN_SAMPLES, 1.5)
    for _ in range(MARGIN_SAMPLES - 1):
        m.add(chunk(1.0))
        m.add(Measured(1, 0, None, 1, late=False))  # decode-only steps count for nothing
    assert not m.learned
    m.add(chunk(1.0))
    assert m.learned  # though the window, of MARGIN_SAMPLES steps, now holds 16 chunk steps
