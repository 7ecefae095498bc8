"""tests/require.py: a missing piece skips, or fails under JAXSERVE_TEST_REQUIRE_ALL=1 (CI)."""

import pytest

from tests.require import import_or_skip, require_or_skip

MISSING = "jaxserve_no_such_module"


def test_skips_without_the_variable(monkeypatch):
    monkeypatch.delenv("JAXSERVE_TEST_REQUIRE_ALL", raising=False)
    require_or_skip(None)  # nothing missing: carries on
    with pytest.raises(pytest.skip.Exception, match="no compiler"):
        require_or_skip("no compiler")
    with pytest.raises(pytest.skip.Exception, match=MISSING):
        import_or_skip(MISSING)
    assert import_or_skip("json").dumps([]) == "[]"


@pytest.mark.parametrize("value", ["1", "true"])
def test_fails_with_the_variable(monkeypatch, value):
    monkeypatch.setenv("JAXSERVE_TEST_REQUIRE_ALL", value)
    require_or_skip(None)
    with pytest.raises(pytest.fail.Exception, match="no compiler.*JAXSERVE_TEST_REQUIRE_ALL"):
        require_or_skip("no compiler")
    with pytest.raises(pytest.fail.Exception, match=MISSING):
        import_or_skip(MISSING)
    monkeypatch.setenv("JAXSERVE_TEST_REQUIRE_ALL", "0")
    with pytest.raises(pytest.skip.Exception):
        require_or_skip("no compiler")
