"""A fixed English text for the quality bench (perplexity and top-1 agreement per weight format). Written for
this project and released with it under its license; about 2,500 tokens with a Llama-style BPE vocabulary."""

QUALITY_TEXT = """\
The Keeper of the Northern Light

For most of the last two centuries, a lighthouse was less a building than a household. A keeper, his family and
often an assistant lived at the foot of the tower, and the light above them had to burn from sunset to sunrise
every night of the year. The work was plain and repetitive. Each evening the keeper climbed the stairs, trimmed
the wicks, filled the reservoirs with oil and wound the clockwork that turned the lens. Each morning he climbed
again to put the flame out, polish the brass and glass, and draw the curtains so that the sun would not scorch
the lamp through the lens. Between those two climbs lay a long night of watching, and in bad weather a keeper
might climb a dozen times to clear soot from the glass or to check that the mechanism still turned.

The lens was the heart of the station. Early lights used reflectors, polished bowls of metal behind each lamp,
and they lost much of their light to the sides. The glass lens that replaced them was built from rings of prisms
arranged around the flame. Each ring bent the rays a little more than the one inside it, so that light leaving
the lamp in many directions left the lens in a single flat beam. A large lens of this kind stood taller than a
man and weighed several tons, yet it floated on a bath of mercury so smoothly that a child could turn it with one
hand. Because the lens was divided into panels, the beam it threw was not steady but swept across the sea like
the spoke of a wheel. A sailor saw a flash each time a panel passed him.

Those flashes carried information. Every light on a coast had its own character: a single flash every five
seconds, two flashes close together followed by darkness, a fixed glow broken by a longer eclipse. A navigator
who counted the seconds between flashes and compared the count with his printed list could tell which light he
was looking at, and therefore where he was. In this sense the lighthouse was an early kind of signal, a message
repeated without end to anyone who cared to read it. The message was simple, but it had to be exact. A clock
that ran slow or a lens that stuck could turn one light into another and send a ship onto the rocks it was trying
to avoid.

Fog was the great enemy. A beam that could be seen twenty miles away on a clear night might vanish within a few
hundred yards when the fog came in, and on many coasts fog arrived without warning. Stations on such coasts were
given a second voice. At first it was a bell, rung by hand or by a falling weight. Later came horns and sirens
driven by compressed air, and the keeper had to stoke a boiler or run an engine for hours at a time. Sound is a
poorer guide than light. It bends over warm and cold layers of air, it fades in some directions and carries in
others, and a sailor who hears a horn can rarely be sure how far away it is. Still, a poor guide was better than
none, and the low note of a fog signal was for generations the most familiar sound of the coast.

Life at a remote station depended on supplies that arrived by boat. Oil, coal, food, letters and tools came out
once a month or once a season, and when storms kept the boat away the household made do with what it had.
Keepers kept gardens where the soil allowed, raised chickens and goats, and fished from the rocks. Children were
taught at home or rowed to a school on the mainland when the weather permitted. Many keepers kept careful logs,
and those books are now a record of weather, shipwrecks, migrating birds and the small events of family life,
written in the same patient hand night after night.

The keeper's most important duty was not the light itself but the rescue that sometimes followed its failure to
prevent a wreck. When a ship struck, the keeper was often the only person who could see it happen, and the only
one with a boat close enough to help. Stories of keepers rowing into heavy seas to bring sailors ashore were told
and retold along every coast. Most rescues were less dramatic. A fishing boat that had lost its way was guided in
by a lantern waved from the rocks, or a swimmer was pulled from the surf by a rope. The light was a promise that
someone was awake.

Change came slowly and then all at once. Oil gave way to gas, gas to electricity, and the clockwork that turned
the lens was replaced by electric motors. Each change removed a little of the keeper's work. Automatic switches
could light the lamp at dusk, and a device that sensed a failed bulb could swing a spare one into place. Radio
beacons and later satellite positioning gave ships ways to find themselves that did not depend on seeing the
shore at all. By the end of the twentieth century most lighthouses ran without anyone living beside them, visited
now and then by a technician who arrived by helicopter, checked the batteries and left before dark.

What was lost in that change is easy to romanticise and hard to measure. The automatic light is more reliable
than the keeper ever was. It does not fall ill, it does not fall asleep, and it does not need a boat to bring it
oil. Yet the keeper did more than keep the light burning. He watched the sea, reported wrecks, recorded the
weather and, in the last resort, went out in his boat. None of that can be done by a switch. Some stations kept
their keepers for years after the light no longer needed them, simply because the coast was safer with someone
watching it.

Today many old towers have found new work. Some are museums, where visitors climb the same stairs the keepers
climbed and look at lenses that no longer turn. Some rent rooms to travellers who want a few nights at the edge
of the land. Others still shine, their beams sweeping the dark exactly as they did a century ago, though the
lamp inside is a small electric bulb and the lens around it is plastic. Ships that pass them rarely need them.
Their charts are drawn on screens, their position is known to within a few yards, and their courses are planned
long before they leave port. The light remains because it costs little to keep and because, when everything else
fails, a flash on the horizon is still something a sailor can count.

There is a lesson in this history for anyone who builds machines that other people depend on. The lighthouse
worked because its behaviour was simple, regular and checked every night by someone who cared whether it was
right. Its character was published so that anyone could verify it. Its failures were recorded in a log that
anyone could read. When the technology changed, the first systems that replaced the keeper were trusted only
after years of running beside him, and even then a spare bulb waited in the holder in case the first one failed.
Reliability was not a property of the lamp alone but of the whole arrangement: the printed list, the clock, the
log, the spare, and the habit of climbing the stairs.

A Short Account of Tides

Anyone who lived beside the sea learned the tides before learning to read. Twice a day the water rises along the
shore and twice a day it falls, and the times shift a little later each day, by a little under an hour. The cause
is the pull of the moon and, to a lesser degree, the sun. The moon pulls hardest on the side of the earth that
faces it and least on the far side, and the difference between those pulls stretches the oceans into two bulges,
one under the moon and one opposite it. As the earth turns beneath the bulges, a coast passes through each of them
once a day, which is why most coasts see two high tides rather than one.

When the sun and the moon line up, at new moon and full moon, their pulls add together and the tides run higher
and lower than usual. These are the spring tides, a name that has nothing to do with the season. When the sun
and moon stand at right angles, at the quarter moons, their pulls partly cancel and the range is smaller. These
are the neap tides. The pattern of springs and neaps repeats roughly every two weeks, and a harbour master could
plan the arrival of heavy ships around it long before there were tables printed for every port.

Real coasts complicate the simple picture. The shape of a bay can amplify the tide until the water rises many
metres, while a nearby stretch of open coast sees only a small change. Narrow channels can make the tide run in
like a river, fast enough to be dangerous, and in a few places the incoming water arrives as a single wave that
travels up a river against its current. Some seas, closed off from the ocean, barely have tides at all. To
predict the tide at a given place, one must measure it there for a long time, break the record into a sum of
regular cycles, and then add the cycles forward into the future. Before computers, this sum was worked out by
machines of gears and pulleys, each wheel turning at the rate of one cycle, with a pen tracing the total on a
moving strip of paper.

Those machines were among the first analogue computers, and they were remarkably accurate. A good one could
produce a year of predictions for a port in a day or two of cranking. The printed tables that came from them
were trusted by fishermen, pilots and navies alike, and errors were rare enough to be remembered. When a table
was wrong, the cause was almost always a change in the harbour itself, a new breakwater or a dredged channel,
rather than a fault in the machine. The sea had changed, and the model had not.

That last point is worth keeping. A model is only as good as the world it was measured in, and when the world
changes the model must be measured again. The keepers knew this, and so did the people who cranked the tide
machines. Both checked their work against what they could see, every day, and both wrote down what they found.
"""
