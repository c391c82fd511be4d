"""A bucket of its own for each S3 test on the loopback server (scripts/s3_server.sh): SeaweedFS
answered some of 13 tests that created one shared bucket at the same time with 404 NoSuchBucket,
so no two tests share a name."""
import uuid


def new_bucket(client, prefix: str) -> str:
    """Creates `<prefix>-<32 random hex digits>` with the boto3 `client` and returns its name."""
    name = f"{prefix}-{uuid.uuid4().hex}"
    client.create_bucket(Bucket=name)
    return name
