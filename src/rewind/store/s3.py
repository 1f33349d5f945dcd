"""Objects in an S3-compatible bucket, through boto3 (imported only by cache.open_objects).

Endpoint, region and credentials come from the usual AWS variables and files
(AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION, AWS_PROFILE,
~/.aws/...), read by boto3 itself. A custom endpoint is addressed path-style
(http://host/bucket/key), which every S3 server accepts; AWS itself is addressed as boto3
chooses. One client serves every thread (boto3 clients are thread-safe).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import boto3
import botocore.config
import botocore.exceptions

from rewind.store.backends import ObjectInfo
from rewind.store.disk import WORKERS
from rewind.store.errors import RemoteUnavailable

# Up to this many requests in flight: uploads and downloads are network-bound, not CPU-bound.
CONNECTIONS = max(16, 4 * WORKERS)
_MISSING = {"404", "NoSuchKey", "NotFound"}
_PRECONDITION = {"412", "PreconditionFailed", "ConditionalRequestConflict"}


class S3Objects:
    """The objects under `prefix` in `bucket`."""

    def __init__(self, bucket: str, prefix: str) -> None:
        self.bucket, self.prefix = bucket, prefix
        self.url = f"s3://{bucket}/{prefix}".rstrip("/")
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        config = botocore.config.Config(
            connect_timeout=5, read_timeout=60, max_pool_connections=CONNECTIONS,
            retries={"max_attempts": 3, "mode": "standard"},
            # Checksums only where S3 requires them: chunks are checked against their BLAKE3
            # names anyway, and S3-compatible servers differ in the newer checksum headers.
            request_checksum_calculation="when_required", response_checksum_validation="when_required",
            s3={"addressing_style": "path"} if endpoint else None)
        region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
        self._client = boto3.session.Session().client("s3", config=config, region_name=region)
        self._conditional: bool | None = None

    def __repr__(self) -> str:
        return f"S3Objects({self.url!r})"

    @contextmanager
    def _errors(self, what: str, key: str | None = None) -> Iterator[None]:
        """Server trouble as RemoteUnavailable; with `key`, a missing object as KeyError and a
        refused condition as FileExistsError."""
        try:
            yield
        except botocore.exceptions.ClientError as e:
            err = e.response.get("Error", {})
            code = str(err.get("Code", ""))
            if key is not None and code in _MISSING:
                raise KeyError(key) from e
            if key is not None and code in _PRECONDITION:
                raise FileExistsError(key) from e
            raise RemoteUnavailable(f"the store at {self.url} refused to {what}: "
                                    f"{code} {err.get('Message') or ''}".rstrip()) from e
        except botocore.exceptions.NoCredentialsError as e:
            raise RemoteUnavailable(f"cannot use the store at {self.url}: no AWS credentials (set "
                                    "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE)") from e
        except (botocore.exceptions.BotoCoreError, OSError) as e:
            raise RemoteUnavailable(f"the store at {self.url} does not answer ({what}): {e}") from e

    def put(self, key: str, data: bytes) -> None:
        with self._errors(f"write {key}"):
            self._client.put_object(Bucket=self.bucket, Key=self.prefix + key, Body=data)

    def put_new(self, key: str, data: bytes) -> bool:
        if not self.conditional_writes():
            if self.exists(key):
                return False
            self.put(key, data)
            return True
        try:
            with self._errors(f"write {key}", key):
                self._client.put_object(Bucket=self.bucket, Key=self.prefix + key, Body=data,
                                        IfNoneMatch="*")
            return True
        except FileExistsError:
            return False

    def get(self, key: str) -> bytes:
        with self._errors(f"read {key}", key):
            body: bytes = self._client.get_object(Bucket=self.bucket, Key=self.prefix + key)["Body"].read()
        return body

    def exists(self, key: str) -> bool:
        try:
            with self._errors(f"look up {key}", key):
                self._client.head_object(Bucket=self.bucket, Key=self.prefix + key)
            return True
        except KeyError:
            return False

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        cut = len(self.prefix)
        with self._errors(f"list {prefix}"):
            pages = self._client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=self.prefix + prefix)
            for page in pages:
                for item in page.get("Contents", ()):
                    yield ObjectInfo(key=item["Key"][cut:], size=item["Size"])

    def delete(self, keys: Iterable[str]) -> None:
        batch = [self.prefix + k for k in keys]
        for i in range(0, len(batch), 1000):  # DeleteObjects takes at most 1000 keys
            with self._errors("delete objects"):
                out = self._client.delete_objects(Bucket=self.bucket, Delete={
                    "Objects": [{"Key": k} for k in batch[i:i + 1000]], "Quiet": True})
            failed = [e for e in out.get("Errors", ()) if e.get("Code") not in _MISSING]
            if failed:
                raise RemoteUnavailable(f"the store at {self.url} did not delete {failed[0].get('Key')}: "
                                        f"{failed[0].get('Code')} {failed[0].get('Message', '')}")

    def conditional_writes(self) -> bool:
        """Found out once per client: a probe object is written twice, the second time with
        If-None-Match: *. rclone 1.74's `serve s3` ignores the header and overwrites."""
        if self._conditional is None:
            probe = f"locks/probe-{os.getpid()}-{id(self):x}"
            self.put(probe, b"1")
            try:
                with self._errors("probe conditional writes", probe):
                    self._client.put_object(Bucket=self.bucket, Key=self.prefix + probe, Body=b"2",
                                            IfNoneMatch="*")
                self._conditional = False
            except FileExistsError:
                self._conditional = True
            finally:
                self.delete([probe])
        return self._conditional
