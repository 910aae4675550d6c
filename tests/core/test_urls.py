"""lb.core.urls: what a replica URL may be, how it is shown, which hosts the admin API refuses."""
from lb.core.urls import DEFAULT_DENY, denied, parse_deny, url_for_display, url_problem


def test_url_problems_name_the_key_and_never_echo_a_password():
    assert url_problem("http://10.0.0.5:30000", "replicas[0].url") is None
    assert url_problem("https://engine.internal/", "k") is None
    for bad in ("ftp://h", "http://", "http://h:0", "http://h:70000", "http://h:x", "http://h/?a=1", "http://h#f",
                "http://h/v1"):
        assert url_problem(bad, "replicas[0].url").startswith("replicas[0].url: "), bad
    msg = url_problem("http://u:hunter2@h:1", "replicas[2].url")
    assert "api_key" in msg and "hunter2" not in msg


def test_display_masks_only_the_password():
    assert url_for_display("redis://:pw@127.0.0.1:6379/0") == "redis://:***@127.0.0.1:6379/0"
    assert url_for_display("redis://user:pw@h/1") == "redis://user:***@h/1"
    assert url_for_display("http://h:1") == "http://h:1"


def test_the_default_deny_list_covers_metadata_but_not_loopback():
    rules = parse_deny(DEFAULT_DENY, "k")
    assert denied("169.254.169.254", [], rules) == "169.254.0.0/16"
    assert denied("evil.example", ["169.254.169.254"], rules) == "169.254.0.0/16"  # by what it resolves to
    assert denied("x", ["::ffff:169.254.169.254"], rules) == "169.254.0.0/16"
    assert denied("Metadata.Google.Internal.", [], rules) == "metadata.google.internal"
    assert denied("fe80::1", [], rules) == "fe80::/10"
    assert denied("127.0.0.1", ["127.0.0.1"], rules) is None
    assert denied("localhost", ["::1"], rules) is None
