"""The KTO family: Kahneman-Tversky Optimization (Ethayarajh et al. 2024) from unpaired, labelled completions."""
