"""Multi-teacher DiffusionOPD (docs/algorithms.md §3): the teacher list, routing by the `teacher` column, and the
weighted KL sum against a float64 reference, gradient included."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from polyrl.algorithms.diffusion_opd import Teacher, distill_kl, multi_teacher_kl, parse_teachers, route_teachers
from polyrl.errors import UserError


def test_one_teacher_path_is_one_unkeyed_teacher():
    assert parse_teachers("/ckpt", None) == [Teacher("/ckpt", 1.0, None)]


def test_teacher_list_defaults_and_errors():
    got = parse_teachers(None, [{"path": "/a"}, {"path": "/b", "weight": 0.5, "key": "ocr"}])
    assert got == [Teacher("/a", 1.0, None), Teacher("/b", 0.5, "ocr")]
    cases = [
        ((None, None), "set exactly one of algorithm.teacher_path"),
        (("/a", [{"path": "/b"}]), "set exactly one of algorithm.teacher_path"),
        ((None, [{"weight": 1.0}]), r"algorithm.teachers\[0\]=.* must be a mapping with a path"),
        ((None, [{"path": "/a", "wieght": 1}]), r"unknown key algorithm.teachers\[0\].wieght; allowed: key, path, weight"),
        ((None, [{"path": "/a"}, {"path": "/b", "weight": 0}]), r"algorithm.teachers\[1\].weight=0 must be a number > 0"),
        ((None, [{"path": "/a", "key": "x"}, {"path": "/b", "key": "x"}]), "key 'x' is given to more than one teacher"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            parse_teachers(*args)


def test_routing_by_the_teacher_column():
    teachers = [Teacher("/all"), Teacher("/ocr", 2.0, "ocr"), Teacher("/art", 1.0, "art")]
    meta = [{"teacher": "ocr"}, {}, {"teacher": "art"}, {"teacher": "ocr", "answer": 3}]
    mask = route_teachers(meta, teachers)
    assert mask.tolist() == [[1, 1, 1, 1], [1, 0, 0, 1], [0, 0, 1, 0]]
    with pytest.raises(UserError, match="teacher='pose' names no teacher of algorithm.teachers \\(keys: art, ocr\\)"):
        route_teachers([{"teacher": "pose"}], teachers)
    with pytest.raises(UserError, match="has no teacher column and every teacher of algorithm.teachers has a key"):
        route_teachers([{}], teachers[1:])


def test_weighted_kl_sum_and_gradient_match_reference():
    """L_i = Σ_j w_j·m_ji·mean_d (μ_i − μ_j,i)²/(2 s_i²); dL_i/dμ_i = Σ_j w_j·m_ji·(μ_i − μ_j,i)/(s_i²·D)."""
    rng = np.random.default_rng(0)
    b, d, weights = 4, 6, [1.0, 2.5, 0.5]
    mu, s = rng.normal(size=(b, d)), np.array([0.1, 0.4, 1.0, 2.0])
    mu_t = [rng.normal(size=(b, d)) for _ in weights]
    mask = np.array([[1, 1, 1, 1], [1, 0, 0, 1], [0, 0, 1, 0]], float)
    want = np.zeros(b)
    want_grad = np.zeros((b, d))
    for j, w in enumerate(weights):
        for i in range(b):
            want[i] += w * mask[j, i] * ((mu[i] - mu_t[j][i]) ** 2).mean() / (2 * s[i] ** 2)
            want_grad[i] += w * mask[j, i] * (mu[i] - mu_t[j][i]) / (s[i] ** 2 * d)
    m = torch.tensor(mu, requires_grad=True)
    kls = [distill_kl(m, torch.tensor(t), torch.tensor(s)) for t in mu_t]
    kls[2] = torch.where(torch.tensor(mask[2] > 0), kls[2], torch.full_like(kls[2], float("nan")))  # unscored rows
    got = multi_teacher_kl(kls, torch.tensor(mask), weights)
    got.sum().backward()
    np.testing.assert_allclose(got.detach().numpy(), want, rtol=1e-12)
    np.testing.assert_allclose(m.grad.numpy(), want_grad, rtol=1e-12)
