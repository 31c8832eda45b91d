"""TLS and mutual TLS on the router port, with certificates made by the test."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import grpc
import pytest
import requests

from poolserve.protos import inference_pb2 as pb
from poolserve.protos import inference_pb2_grpc as pbg
from poolserve.service.contract.settings import ConfigError, load_server_settings

from certs import make_certs
from serving import Serving
from support import copy_example

pytestmark = pytest.mark.e2e


def tls_repo(tmp_path: Path, mutual: bool) -> tuple[Path, Path]:
    certs = make_certs(tmp_path / "certs")
    repo = tmp_path / "repo"
    copy_example(repo, "echo")
    settings = {
        "tls_cert_file": str(certs / "server.crt"),
        "tls_key_file": str(certs / "server.key"),
    }
    if mutual:
        settings["tls_client_ca_file"] = str(certs / "ca.crt")
    (repo / "settings.json").write_text(json.dumps(settings))
    return repo, certs


async def refused(channel: grpc.aio.Channel) -> grpc.StatusCode:
    stub = pbg.GRPCInferenceServiceStub(channel)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.ServerLive(pb.ServerLiveRequest(), timeout=5)
    return info.value.code()


def test_tls_and_plaintext_refused(tmp_path: Path) -> None:
    repo, certs = tls_repo(tmp_path, mutual=False)
    ca = (certs / "ca.crt").read_bytes()

    async def main(address: str) -> None:
        creds = grpc.ssl_channel_credentials(root_certificates=ca)
        async with grpc.aio.secure_channel(address, creds) as channel:
            assert (
                await pbg.GRPCInferenceServiceStub(channel).ServerLive(pb.ServerLiveRequest())
            ).live
        async with grpc.aio.insecure_channel(address) as plain:
            assert await refused(plain) == grpc.StatusCode.UNAVAILABLE

    with Serving(repo, tmp_path / "run") as serving:
        asyncio.run(main(serving.address))


def test_mutual_tls_requires_a_client_certificate(tmp_path: Path) -> None:
    repo, certs = tls_repo(tmp_path, mutual=True)
    ca = (certs / "ca.crt").read_bytes()
    key = (certs / "client.key").read_bytes()
    cert = (certs / "client.crt").read_bytes()

    async def main(address: str) -> None:
        with_cert = grpc.ssl_channel_credentials(ca, key, cert)
        async with grpc.aio.secure_channel(address, with_cert) as channel:
            live = await pbg.GRPCInferenceServiceStub(channel).ServerLive(pb.ServerLiveRequest())
            assert live.live
        without = grpc.ssl_channel_credentials(root_certificates=ca)
        async with grpc.aio.secure_channel(address, without) as channel:
            assert await refused(channel) == grpc.StatusCode.UNAVAILABLE

    with Serving(repo, tmp_path / "run") as serving:
        asyncio.run(main(serving.address))


def test_the_rest_port_has_the_same_tls(tmp_path: Path) -> None:
    repo, certs = tls_repo(tmp_path, mutual=True)
    client = (str(certs / "client.crt"), str(certs / "client.key"))
    with Serving(repo, tmp_path / "run") as serving:
        http = (serving.run_dir / "http.addr").read_text().strip()
        url = f"https://{http}/v2/health/live"
        live = requests.get(url, verify=str(certs / "ca.crt"), cert=client, timeout=30)
        assert live.status_code == 200
        # no client certificate: refused in the handshake (TLS 1.3: right after it)
        with pytest.raises(requests.exceptions.ConnectionError):
            requests.get(url, verify=str(certs / "ca.crt"), timeout=30)
        with pytest.raises(requests.exceptions.ConnectionError):  # plaintext
            requests.get(f"http://{http}/v2/health/live", timeout=30)


def test_half_a_tls_configuration_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "settings.json").write_text(json.dumps({"tls_cert_file": "/nonexistent.crt"}))
    with pytest.raises(ConfigError, match="tls_cert_file"):
        load_server_settings(tmp_path, environ={})
