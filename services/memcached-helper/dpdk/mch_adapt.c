/*
 * mch_adapt.c - PostMan's Algorithm 1 with bounds (see mch_adapt.h).
 * Thresholds in integer arithmetic: s < 0.75 S is 4 s < 3 S, and so on.
 */
#include "mch_adapt.h"

static uint64_t clamp(uint64_t v, uint64_t lo, uint64_t hi)
{
	return v < lo ? lo : v > hi ? hi : v;
}

void mch_adapt_init(struct mch_adapt *a, uint64_t s_init, uint64_t s_min, uint64_t s_max,
		    uint64_t t_init, uint64_t t_min, uint64_t t_max)
{
	if (s_max < s_min)
		s_max = s_min;
	if (t_max < t_min)
		t_max = t_min;
	a->s_min = s_min;
	a->s_max = s_max;
	a->t_min = t_min;
	a->t_max = t_max;
	a->S = clamp(s_init, s_min, s_max);
	a->T = clamp(t_init, t_min, t_max);
	a->s_moves = a->t_moves = 0;
}

void mch_adapt_update(struct mch_adapt *a, uint64_t s, uint64_t t)
{
	if ((4u * s < 3u * a->S || 4u * s > 5u * a->S) && s >= a->s_min) {
		uint64_t v = s < a->s_max ? s : a->s_max;

		if (v != a->S) {
			a->S = v;
			a->s_moves++;
		}
	}
	if ((2u * t < a->T || 2u * t > 3u * a->T) && t >= a->t_min) {
		uint64_t v = t < a->t_max ? t : a->t_max;

		if (v != a->T) {
			a->T = v;
			a->t_moves++;
		}
	}
}
