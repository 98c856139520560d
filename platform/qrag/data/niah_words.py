"""Word lists for RULER-style needle keys ("adjective-noun", e.g. ``quiet-harbor``).

RULER draws its word keys from the ``wonderwords`` lists; these are our own lists of common
English words, long enough for ~200K distinct keys without any extra dependency.
"""

ADJECTIVES = tuple(
    sorted(
        set(
            """
abandoned able absent absurd abundant accurate acidic active adorable adventurous afraid agile
alert alive amber ambitious amused ancient angry anxious arctic aromatic ashamed autumn awake
awful bald barren bashful beautiful belated beloved bitter bizarre blank blissful blue blushing
bold bony boring bouncy brave breezy brief bright brilliant brisk broken bronze bubbly bulky
bumpy busy calm capable careful careless caring cautious charming cheap cheerful chilly chubby
clean clever cloudy clumsy coarse cold colossal comfortable common complete confused cool
copper cosmic courageous cozy crafty cranky crazy creamy creepy crimson crisp crooked crowded
cruel crunchy curious curly cute damp dangerous daring dark dazzling deep defiant delicate
delightful dense dependable desert determined devoted different digital diligent dim dirty
distant dizzy drab dreamy dry dull dusty eager early earnest easy eastern elastic electric
elegant emerald empty enchanted endless energetic enormous envious equal evasive even evil
exotic expert faded faint fair faithful famous fancy fantastic far fast fearless feeble festive
fierce filthy fine firm flat flawless fluffy foggy fond foolish forgetful formal fragile
fragrant frail frantic free fresh friendly frozen fuzzy gentle giant giddy gifted gigantic
glamorous glass gleaming glorious glossy golden good graceful grand grateful gray greasy great
green grim grumpy guilty happy hard harmless harsh hasty healthy heavy helpful hidden high
hollow holy honest hopeful horrible hot huge humble hungry hurried icy idle immense important
impossible indigo innocent intense invisible itchy jagged jealous jolly joyful juicy jumpy keen
kind knotty known large late lavish lazy lean legal level light likely limp liquid little lively
lonely long loose loud lovely loyal lucky lunar magenta magic majestic mammoth marble massive
mature meager mellow melodic merry messy mighty mild misty modern modest moist molten mossy
muddy mute mysterious narrow nasty natural neat nervous new nice nimble noble noisy normal
northern numb obedient obvious odd old olive open orange ordinary organic outer oval overt
painful pale paper parallel patient peaceful perfect petite plain plastic pleasant plump polar
polished polite poor popular precious pretty prickly proud purple puzzled quaint quick quiet
radiant rapid rare raspy raw ready real red regal remote rich rigid ripe roasted robust rocky
rosy rough round royal rusty sad safe salty sandy scarlet scented secret serene shaggy shallow
sharp shiny short shy silent silky silver simple sleepy slender slim slow small smart smooth
snowy soft solar solid sour southern sparkling speedy spicy splendid spotless square stable
stale steady steep sticky stormy strange strict striped strong stubborn sturdy subtle sudden
sunny super sweet swift tall tame tangy tart tender tense thick thin thirsty tidy tight tiny
tired tranquil tropical true turquoise twin ugly unique upbeat urban vacant vague valiant vast
velvet vibrant violet vivid warm wary watery weak wealthy weary western wet whole wicked wide
wild windy wise witty wooden worried young youthful zany zealous
""".split()
        )
    )
)

NOUNS = tuple(
    sorted(
        set(
            """
acorn actor airport album alley almond anchor angle ankle answer antler apple apron arch arena
armchair arrow artist atlas attic author avenue award axe badge bagel bakery balcony ball
balloon bamboo banana band banjo bank banner barn barrel basket bath battery beach beacon bean
bear beard bed bee beetle bell belt bench berry bicycle bird biscuit blanket blender block
blossom boat bonnet book boot bottle boulder bowl box bracelet branch bread brick bridge
broom brook brush bubble bucket buffalo bugle building bulb bundle butter button cabin cabinet
cable cactus cake calendar camel camera campus canal candle cannon canoe canvas canyon cap
captain car card carpet carrot cart castle cat cave cedar cellar chair chalk channel chapel
cheese cherry chess chest chicken chimney circle city clarinet clay cliff clock cloud clover
coat cobra coconut coffee coin comet compass cookie copper coral cord cottage cotton couch
country court cousin cow crab crane crater crayon creek cricket crown crystal cup curtain
cushion cycle dagger daisy dancer dawn deer desert desk diamond dinosaur dish doctor dog doll
dolphin donkey door dragon drawer dream dress drum duck dune eagle earth easel eel egg elbow
elephant elk ember emerald engine envelope eraser falcon farm feather fence fern ferry field
fig finch fire fish flag flame flute fog forest fork fountain fox frame frog fruit furnace
galaxy garden garlic gate gazelle gem giant ginger giraffe glacier glove goat gold goose
gorilla grape grass guitar gull hall hammer hamster harbor harp hat hawk hazel hedge helmet
hen herb heron hill hive hobby honey hook horizon horn horse hotel house hut island ivory
jacket jaguar jam jar jasmine jellyfish jewel journal judge jungle kangaroo kayak kettle key
kingdom kitchen kite kitten knight knot koala label ladder lagoon lake lamp lantern laptop
lark lava lawn leaf ledge lemon leopard letter library lily lime lion lizard lobster locket
lodge lotus lynx magnet mango maple map marble market mask meadow melon mermaid meteor
microscope mill mirror mitten monkey moon moose mosaic moth mountain mouse mug museum
mushroom needle nest net newt night notebook nut oak oar oasis ocean octopus office olive
onion opera orange orbit orchard orchid otter owl ox oyster paddle pagoda palace palm panda
panther paper parade parrot path peach peacock peak pear pearl pebble pelican pen pencil
penguin pepper piano pickle pigeon pillow pilot pine pipe pirate planet plate plum pocket
poem pond pony poppy porch potato pottery prairie prism pumpkin puppet puzzle pyramid quail
quarry quartz queen quill quilt rabbit raccoon radio raft rain rainbow raven reef ribbon rice
ridge river road robin rock rocket roof rose ruby rug saddle sail salmon sand sandal satchel
saucer scarf school scroll sea seal seed shadow shark sheep shell shelter ship shoe shore
shovel sierra silk singer sink skate sky sled slipper snail snake snow sofa soldier song
spark sparrow sphere spider spoon spring squirrel stable stage star station statue stone
stool storm stove straw stream street sugar summit sun swan sweater swing sword table tablet
tail tiger timber toast tomato tower town toy tractor trail train tree triangle trumpet
tulip tunnel turtle umbrella unicorn valley vase velvet violin volcano wagon walnut wand
wardrobe wasp watch waterfall wave whale wheat wheel whistle willow window wing winter wizard
wolf wood wren yacht yak yard yarn zebra zephyr zipper
""".split()
        )
    )
)
