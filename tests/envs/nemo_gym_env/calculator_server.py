"""A NeMo Gym resources server for the connector's tests: the calculator of ``tests/agentic``.

It runs in NeMo Gym's own environment (Python 3.12 or newer, ``requirements.txt`` beside this
file), never in Miles' (Python 3.11 in CI, which nemo-gym does not install on). It is a
``SimpleResourcesServer`` as NeMo Gym's own environments are: a ``/calculator`` tool, a
``/seed_session`` and a ``/verify`` that reads the episode's ``response``, with per-episode state
kept under NeMo Gym's session cookie. ``python calculator_server.py PORT`` serves it on 127.0.0.1
the way NeMo Gym's ``run_webserver`` does, less the Ray cluster and head server that ``ng_run``
starts around it.
"""

from __future__ import annotations

import ast
import operator
import sys

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse
from nemo_gym.base_resources_server import (
    BaseResourcesServerConfig,
    BaseRunRequest,
    BaseSeedSessionResponse,
    BaseVerifyRequest,
    BaseVerifyResponse,
    SimpleResourcesServer,
)
from nemo_gym.config_types import BaseServerConfig
from nemo_gym.server_utils import SESSION_ID_KEY, ServerClient
from omegaconf import OmegaConf
from pydantic import BaseModel, Field

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def evaluate(expression: str) -> int:
    """Integer +, - and * only (the episodes need no more); anything else is a ValueError."""

    def walk(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.left), walk(node.right))
        raise ValueError(f"cannot evaluate {expression!r}")

    return walk(ast.parse(expression, mode="eval").body)


class CalculatorRunRequest(BaseRunRequest):
    expected: str  # the answer the last assistant message must be
    fail_tool: bool = False  # the tool raises (NeMo Gym answers 500 with the exception's repr)
    fail_verify: bool = False  # /verify raises (the environment broke)


class CalculatorVerifyRequest(CalculatorRunRequest, BaseVerifyRequest):
    pass


class CalculatorVerifyResponse(BaseVerifyResponse):
    expected: str
    answer: str
    session_tool_calls: int  # calculator calls made under this episode's session cookie


class CalculatorRequest(BaseModel):
    expression: str


class CalculatorServer(SimpleResourcesServer):
    config: BaseResourcesServerConfig
    calls: dict[str, int] = Field(default_factory=dict)
    failing: set[str] = Field(default_factory=set)

    def setup_webserver(self) -> FastAPI:
        app = super().setup_webserver()
        app.post("/calculator")(self.calculator)
        return app

    async def seed_session(self, request: Request, body: CalculatorRunRequest) -> BaseSeedSessionResponse:
        session_id = request.session[SESSION_ID_KEY]
        self.calls[session_id] = 0
        if body.fail_tool:
            self.failing.add(session_id)
        return BaseSeedSessionResponse()

    async def calculator(self, request: Request, body: CalculatorRequest) -> PlainTextResponse:
        session_id = request.session[SESSION_ID_KEY]
        self.calls[session_id] = self.calls.get(session_id, 0) + 1
        if session_id in self.failing:
            raise RuntimeError("the calculator's backend went away")
        return PlainTextResponse(str(evaluate(body.expression)))

    async def verify(self, request: Request, body: CalculatorVerifyRequest) -> CalculatorVerifyResponse:
        if body.fail_verify:
            raise RuntimeError("the grader went away")
        messages = [o for o in body.response.output if o.type == "message"]
        answer = "".join(c.text for c in messages[-1].content if c.type == "output_text") if messages else ""
        return CalculatorVerifyResponse(
            **body.model_dump(),
            reward=float(answer.strip() == body.expected),
            answer=answer,
            session_tool_calls=self.calls.get(request.session[SESSION_ID_KEY], 0),
        )


def main(port: int) -> None:
    config = BaseResourcesServerConfig(host="127.0.0.1", port=port, entrypoint="", name="calculator")
    client = ServerClient(
        head_server_config=BaseServerConfig(host="127.0.0.1", port=port),
        global_config_dict=OmegaConf.create({}),
    )
    server = CalculatorServer(config=config, server_client=client)
    app = server.setup_webserver()
    server.setup_liveness(app)
    server.setup_exception_middleware(app)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


if __name__ == "__main__":
    main(int(sys.argv[1]))
