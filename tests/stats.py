"""Statistics the tests need, in torch (no SciPy)."""
import torch


def chi2_contingency_pvalue(table) -> float:
    """Pearson's chi-square test of independence on a contingency table [R, K] of counts (SciPy's
    chi2_contingency without Yates' correction, which SciPy applies only when there is one degree of freedom):
    statistic sum (O - E)^2 / E with E = row total * column total / N, on (R - 1)(K - 1) degrees of freedom; the
    p-value is the chi-square survival function, Q(dof / 2, statistic / 2) (the regularized upper incomplete
    gamma function)."""
    observed = torch.as_tensor(table, dtype=torch.float64)  # [R, K]
    expected = observed.sum(1, keepdim=True) * observed.sum(0, keepdim=True) / observed.sum()  # [R, K]
    statistic = ((observed - expected) ** 2 / expected).sum()
    dof = (observed.shape[0] - 1) * (observed.shape[1] - 1)
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), statistic / 2))
