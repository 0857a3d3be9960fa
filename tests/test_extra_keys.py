"""Engine extra-config keys kvcached does not read are named at start (pure logic): a typo would
otherwise take the default silently - for `namespace`, no tenant salt."""
from kvcached_client.extra_keys import unknown_keys

KNOWN = ("instance", "namespace", "run_dir", "timeout_s")


def test_a_misspelt_key_is_named_with_the_key_it_resembles():
    said = unknown_keys({"namespce": "tenant-a", "instance": "gpu0"}, KNOWN)
    assert said == ["extra-config key 'namespce' is not read by kvcached; did you mean 'namespace'?"]


def test_an_unknown_key_lists_what_is_read_unless_the_engine_reads_the_config_too():
    assert unknown_keys({"colour": "red"}, KNOWN) == [
        "extra-config key 'colour' is not read by kvcached (kvcached reads instance, namespace, "
        "run_dir, timeout_s)"]
    # SGLang reads its extra-config too: only near misses of kvcached's keys are said
    assert unknown_keys({"prefetch_threshold": 256, "timeout": 3}, KNOWN, all_unknown=False) == [
        "extra-config key 'timeout' is not read by kvcached; did you mean 'timeout_s'?"]
    assert unknown_keys({"instance": "a", "run_dir": "/r"}, KNOWN) == []
