"""The GPU a plan is made for: memory, bandwidth and PCIe link, by name (`--gpu NAME`), from
the device itself, or the CPU standing in for one.

Figures are the vendors' documented ones (NVIDIA's product pages: memory size, memory
bandwidth, PCIe generation and lanes). A plan prices reads at `ACHIEVED` of the documented
bandwidth, the same fraction for Ember and for llama.cpp (batch-1 decode of quantized blocks
reaches about 60-80% of the peak on these cards in either engine). A card named with `--gpu`
is priced as named; without one, a real CUDA device's own properties (`device_card`): its
memory and, where PyTorch reports the memory clock and bus width, its bandwidth; the link is
the table's when the name matches, else PCIe 4.0 x16. The "cpu" profile (`cpu_card`) is the host measured as a tier: the copy bandwidth
`ember bench decode` measures, no link to cross.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ember.models.support.errors import ConfigError

ACHIEVED = 0.75  # of a card's documented bandwidth, batch-1 reads of quantized blocks
# GB/s per lane and direction after encoding: PCIe 3.0, 4.0, 5.0
_LANE_GBPS = {3: 0.985, 4: 1.969, 5: 3.938}


@dataclass(frozen=True)
class GpuCard:
    name: str
    memory: int  # bytes
    gbps: float  # documented memory bandwidth, GB/s
    pcie_gen: int  # 0: no link (the CPU standing in for a GPU)
    pcie_lanes: int
    source: str = "table"  # "table", "device" (its own properties) or "measured" (cpu)

    @property
    def read_gbps(self) -> float:
        """What a decode step's reads reach: `ACHIEVED` of the documented figure (the cpu
        profile's measured copy bandwidth as is)."""
        return self.gbps if self.source == "measured" else self.gbps * ACHIEVED

    @property
    def link_gbps(self) -> float:
        """One direction of the PCIe link, GB/s (inf: no link, nothing to cross)."""
        if self.pcie_gen == 0:
            return float("inf")
        return _LANE_GBPS[self.pcie_gen] * self.pcie_lanes

    def to_dict(self) -> dict:
        return {**asdict(self), "read_gbps": round(self.read_gbps, 1),
                "link_gbps": None if self.pcie_gen == 0 else round(self.link_gbps, 1)}


_GIB = 1 << 30
# Ordered by memory, then bandwidth: `card_for_budget` takes the first that holds a budget.
CARDS = {c.name: c for c in (
    GpuCard("rtx4060", 8 * _GIB, 272.0, 4, 8),        # RTX 4060 8 GB, 128-bit GDDR6
    GpuCard("rtx3060", 12 * _GIB, 360.0, 4, 16),      # RTX 3060 12 GB, 192-bit GDDR6
    GpuCard("rtx4070", 12 * _GIB, 504.2, 4, 16),      # RTX 4070 12 GB, 192-bit GDDR6X
    GpuCard("rtx4060ti-16", 16 * _GIB, 288.0, 4, 8),  # RTX 4060 Ti 16 GB, 128-bit GDDR6
    GpuCard("rtx3090", 24 * _GIB, 936.2, 4, 16),      # RTX 3090 24 GB, 384-bit GDDR6X
    GpuCard("rtx4090", 24 * _GIB, 1008.0, 4, 16),     # RTX 4090 24 GB, 384-bit GDDR6X
)}


def card(name: str) -> GpuCard:
    """The table's card called `name` (`--gpu NAME`)."""
    key = name.lower().replace(" ", "").replace("-", "").replace("_", "")
    for c in CARDS.values():
        if c.name.replace("-", "") == key:
            return c
    raise ConfigError(f"unknown --gpu {name!r}; choose one of {', '.join(CARDS)}")


def card_for_budget(budget: int) -> GpuCard:
    """The first card of the table (smallest memory, then slowest) that has `budget` bytes."""
    for c in CARDS.values():
        if c.memory >= budget:
            return c
    raise ConfigError(f"no card in the table has {budget / _GIB:.1f} GiB; the largest has "
                      f"{max(c.memory for c in CARDS.values()) // _GIB} GiB")


def check_budget(c: GpuCard, budget: int) -> None:
    """A budget the card cannot hold is the user's mistake: say which card and how much."""
    if c.pcie_gen and budget > c.memory:
        raise ConfigError(f"--gpu-budget {budget / _GIB:.1f} GiB is more than the "
                          f"{c.name}'s {c.memory / _GIB:.0f} GiB; lower it or name a bigger "
                          "card with --gpu")


def device_card(props) -> GpuCard:
    """A CUDA device's profile from `torch.cuda.get_device_properties(device)`."""
    name = str(props.name)
    known = next((c for c in CARDS.values()
                  if c.name.removeprefix("rtx").replace("-16", "") in name.lower().replace(" ", "")
                  and abs(c.memory - props.total_memory) < 2 * _GIB), None)
    clock_khz = getattr(props, "memory_clock_rate", 0) or 0
    bus_bits = getattr(props, "memory_bus_width", 0) or 0
    if clock_khz and bus_bits:  # double data rate: two transfers a clock
        gbps = 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9
    elif known is not None:
        gbps = known.gbps
    else:
        raise ConfigError(f"cannot tell the memory bandwidth of {name!r}: PyTorch reports no "
                          f"memory clock; name the closest card with --gpu ({', '.join(CARDS)})")
    gen, lanes = (known.pcie_gen, known.pcie_lanes) if known else (4, 16)
    return GpuCard(name, int(props.total_memory), gbps, gen, lanes, "device")


def cpu_card(copy_bytes_per_s: float, memory: int) -> GpuCard:
    """The CPU as the tier: reads at the measured copy bandwidth, no link to cross."""
    return GpuCard("cpu", memory, copy_bytes_per_s / 1e9, 0, 0, "measured")
