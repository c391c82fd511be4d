"""The fault proxy as boto3 sees it, through the `fault_proxy` fixture, in front of moto."""
import os
import uuid

import boto3
import pytest
from botocore.config import Config
from botocore.exceptions import (BotoCoreError, ClientError, IncompleteReadError, ResponseStreamingError)

from s3_util import new_bucket


def s3(endpoint: str, attempts: int):
    return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                        aws_access_key_id="testing", aws_secret_access_key="testing",
                        config=Config(retries={"mode": "standard", "total_max_attempts": attempts},
                                      connect_timeout=5, read_timeout=10))


@pytest.fixture
def direct():
    """A client of the S3 server itself, to see what really landed."""
    return s3(os.environ["HSLAKE_TEST_S3_ENDPOINT"], 1)


@pytest.fixture
def bucket(direct):
    """This test's own bucket."""
    return new_bucket(direct, "hslake-fault-proxy-py")


def key(name: str) -> str:
    return f"{uuid.uuid4().hex}/{name}"


def test_slow_down_is_retried_by_boto3_and_the_put_lands(fault_proxy, direct, bucket):
    fault_proxy.set_rules([{"name": "throttle", "method": "PUT", "from": 1, "to": 2,
                            "fault": {"kind": "status", "code": 503}}])
    k = key("a.bin")
    s3(fault_proxy.endpoint, 5).put_object(Bucket=bucket, Key=k, Body=b"x" * 1000)
    c = fault_proxy.counters()
    assert c["faults"] == {"status_503": 2}
    assert c["rules"][0]["matched"] == 3
    assert direct.get_object(Bucket=bucket, Key=k)["Body"].read() == b"x" * 1000


def test_reset_after_on_a_conditional_put_lands_although_boto3_saw_an_error(fault_proxy, direct, bucket):
    fault_proxy.set_rules([{"name": "lost-commit", "method": "PUT", "key": r"_hslake/versions/.*\.json$",
                            "header": "If-None-Match", "from": 1, "to": 2, "fault": {"kind": "reset_after"}}])
    # One attempt: an error for a write that happened.
    k = key("_hslake/versions/00000001.json")
    with pytest.raises(BotoCoreError):
        s3(fault_proxy.endpoint, 1).put_object(Bucket=bucket, Key=k, Body=b"{}", IfNoneMatch="*")
    assert direct.get_object(Bucket=bucket, Key=k)["Body"].read() == b"{}"
    # With retries (the rule spares the retry, match 3) the retry meets its own object: 412, the classic put-if-absent failure.
    k = key("_hslake/versions/00000002.json")
    with pytest.raises(ClientError) as e:
        s3(fault_proxy.endpoint, 3).put_object(Bucket=bucket, Key=k, Body=b"{}", IfNoneMatch="*")
    assert e.value.response["Error"]["Code"] == "PreconditionFailed"
    assert direct.head_object(Bucket=bucket, Key=k)["ContentLength"] == 2
    # Unconditional puts are not matched.
    s3(fault_proxy.endpoint, 1).put_object(Bucket=bucket, Key=k, Body=b"{}")
    c = fault_proxy.counters()
    assert c["faults"] == {"reset_after": 2}
    assert c["rules"][0]["matched"] == 3


def test_truncated_get_is_an_error_never_short_data(fault_proxy, direct, bucket):
    k = key("b.bin")
    direct.put_object(Bucket=bucket, Key=k, Body=os.urandom(64 * 1024))
    fault_proxy.set_rules([{"method": "GET", "fault": {"kind": "truncate", "bytes": 1000}}])
    body = s3(fault_proxy.endpoint, 1).get_object(Bucket=bucket, Key=k)["Body"]
    with pytest.raises((IncompleteReadError, ResponseStreamingError)):
        body.read()
    assert fault_proxy.counters()["faults"] == {"truncate": 1}


def test_rules_by_count_and_key_then_cleared(fault_proxy, direct, bucket):
    fault_proxy.set_rules([{"key": r"/data/", "from": 2, "to": 2, "fault": {"kind": "status", "code": 500}}])
    client = s3(fault_proxy.endpoint, 1)
    outcomes = []
    for name in ["data/0", "other/0", "data/1", "data/2"]:
        try:
            client.put_object(Bucket=bucket, Key=key(name), Body=b"1")
            outcomes.append(True)
        except ClientError as e:
            assert e.response["Error"]["Code"] == "InternalError"
            outcomes.append(False)
    assert outcomes == [True, True, False, True]
    fault_proxy.clear_rules()
    assert fault_proxy.rules()["rules"] == []
    fault_proxy.reset_counters()
    assert fault_proxy.counters() == {"requests": 0, "faults": {}, "rules": []}


def test_bad_rules_are_refused_with_the_reason_and_the_old_ones_stay(fault_proxy):
    fault_proxy.set_rules([{"name": "keep", "fault": {"kind": "reset_before"}}])
    with pytest.raises(ValueError, match="status 404 needs s3_code"):
        fault_proxy.set_rules([{"fault": {"kind": "status", "code": 404}}])
    with pytest.raises(ValueError, match="unknown field `metod`"):
        fault_proxy.set_rules([{"metod": "PUT", "fault": {"kind": "reset_before"}}])
    assert [r["name"] for r in fault_proxy.rules()["rules"]] == ["keep"]
